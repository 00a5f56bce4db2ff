"""Findings that only the data write: a hand-written sentence of results/README.md that states
an outcome links a verdict row whose outcome (after Holm) it repeats; the generated blocks are
written from the verdict rows and are left out of this check. And every figure the hand-written
text gives with an interval is one that a committed run under results/ gives."""

import glob
import json
import os
import re

import pytest

from experiments.report import claims
from experiments.report import committed
from experiments.report import results_table

README = os.path.join(committed.RESULTS_ROOT, "README.md")
# Words and phrases that state what the data show ("and the like": their inflections and kin),
# one group a line. A sentence with any of them states an outcome; one without says how the runs
# were made (the planted sentences below hold both kinds).
OUTCOME_PHRASES = (
    # the words issue 65 started from
    r"holds?|held|no LMC|agrees?|agreed|differs?|differed|rises?|rose|falls?|fell|comes? close|"
    r"explains?|explained|precludes?|is connected|are connected|linearly connected|out of reach|"
    r"reaches full-model LMC|reaches LMC|no method reaches|stays? off",
    # the verdicts' other words
    r"consistent|undetermined|no gap",
    # a place against a value: "is below", "lies inside", "just below the paper's"
    r"(?:is|are|was|were|lies?|lay|sits?|sat|stays?|stayed|ends?|ended|remains?|comes? out)\s+"
    r"(?:just\s+|far\s+|well\s+|wholly\s+|still\s+)?(?:below|above|inside|outside|under|over|"
    r"within|beyond)",
    r"just (?:below|above|under|over|inside|outside)",
    # comparisons: "lower than", "better", "as good as", "3.9 points more", "far from"
    r"(?:lower|higher|less|more|smaller|larger|greater|fewer|wider|narrower|weaker|stronger)\s+"
    r"than|better|worse|as (?:good|bad|high|low|large|small|wide|narrow) as|"
    r"points? (?:less|more|lower|higher)|far (?:from|below|above|weaker|stronger)",
    # superlatives: "the lowest", "the least stable setting", "leaves the least"
    r"lowest|highest|worst|(?:least|most) (?:un)?stable|the least",
    # effects: "helps", "does not help", "improves", "reduces", "raises", "lowers", "doubled"
    r"help(?:s|ed)?|hurts?|improves|improved|reduces|raises?|raised|lowers|lowered|"
    r"(?:does|do|did) not (?:lower|raise|reduce|change|learn)|increases?|increased|decreases?|"
    r"decreased|removes|doubled|halved|moves?|moved|went from",
    # a null result read off an interval: "includes 0", "not shown", "cannot tell them apart"
    r"(?:includes?|including|excludes?|excluding|covers?|covering) (?:0|zero)|"
    r"not shown (?:to|below|above)|"
    r"(?:does|do|did) not show|told apart|tell(?: \w+){1,3} apart",
    # a goal met or missed
    r"miss(?:es|ed)|(?:meets?|met) (?:its |the |their )?goals?|goals? (?:is |are )?met",
)
OUTCOME = re.compile(r"\b(?:" + "|".join(OUTCOME_PHRASES) + r")\b", re.I)
LINK = re.compile(r"\]\(#([a-z0-9-]+)\)")
# The sentences issue 65 quoted, each gone from the README.
QUOTED = ("holds at no width", "no method reaches full-model LMC",
          "leave full-model LMC out of reach", "The ViT comes close",
          "its learned barrier's interval reaches 0 at every width",
          "so the pipeline finds LMC where it exists", "the fewer the training images",
          "move in opposite directions", "falls with width", "three and a half doublings",
          "No LMC after full-model re-initialisation by weight matching",
          "is not what holds the language models", "its means stay off their targets")


def generated_blocks(text: str) -> tuple[str, str]:
  """``text`` without its generated blocks (between the markers of ``results_table``) and its
  code blocks, and the generated blocks joined."""
  blocks = []
  for name in dir(results_table):
    if name.endswith("BEGIN"):
      begin, end = getattr(results_table, name), getattr(results_table, name[:-5] + "END")
      while begin in text:
        head, rest = text.split(begin, 1)
        block, tail = rest.split(end, 1)
        blocks.append(block)
        text = head + tail
  return re.sub(r"```.*?```", "", text, flags=re.S), "\n".join(blocks)


def hand_written(text: str) -> str:
  """``text`` without its generated blocks, code blocks, tables and headings."""
  text = generated_blocks(text)[0]
  return "\n".join(line for line in text.splitlines() if not line.startswith(("|", "#")))


def sentences(text: str) -> list[str]:
  """The sentences of the paragraphs of ``text``, each on one line."""
  out = []
  for paragraph in re.split(r"\n\s*\n", text):
    flat = " ".join(paragraph.split())
    out += [s for s in re.split(r"(?<=[.!?])\s+(?=[A-Z*\[`(-])", flat) if s]
  return out


def unsupported(text: str, outcomes: dict[str, str]) -> list[str]:
  """The hand-written sentences of ``text`` that state an outcome (``OUTCOME``) without linking
  a verdict row (anchor -> its outcome after Holm, ``outcomes``) whose outcome they repeat."""
  bad = []
  for sentence in sentences(hand_written(text)):
    if not OUTCOME.search(sentence):
      continue
    rows = [outcomes.get(anchor) for anchor in LINK.findall(sentence)]
    if not rows or any(r is None or r not in sentence for r in rows):
      bad.append(sentence)
  return bad


@pytest.fixture(scope="module")
def outcomes():
  return {r.anchor: r.corrected for r in claims.verdict_rows(committed.RESULTS_ROOT)}


def test_every_outcome_the_readme_states_by_hand_links_a_row_that_says_it(outcomes):
  with open(README, encoding="utf-8") as f:
    text = f.read()
  assert unsupported(text, outcomes) == []


def test_the_sentences_the_issue_quoted_are_gone():
  with open(README, encoding="utf-8") as f:
    text = " ".join(f.read().split())
  assert [q for q in QUOTED if q in text] == []


@pytest.mark.parametrize("sentence", [
    "The ViT comes close: its learned barrier's interval reaches 0 at every width.",
    "No LMC after full-model re-initialisation by weight matching.",
    "The positive control is connected, so the pipeline finds LMC where it exists.",
])
def test_a_quoted_sentence_put_back_fails(outcomes, sentence):
  with open(README, encoding="utf-8") as f:
    text = f.read()
  assert unsupported(text + "\n\n" + sentence + "\n", outcomes) == [sentence]


def test_a_sentence_that_links_its_row_and_repeats_its_outcome_passes(outcomes):
  anchor, outcome = next(iter(outcomes.items()))
  good = f"The trend [row](#{anchor}) is {outcome}; it holds as the row says."
  wrong = f"It holds on [row](#{anchor}), {'agrees' if outcome != 'agrees' else 'differs'}."
  assert unsupported(good, outcomes) == []
  assert unsupported(wrong, outcomes) == [wrong]


@pytest.mark.parametrize("sentence", [
    # issue 65's second list, and the like
    "Variant 2 and full both reach 6.4 % of naive, just below the paper's 7-12 %.",
    "Small data and early stops make this the least stable setting.",
    "Activation matching is below weight matching on GPT-2.",
    "REPAIR does not help these transformers.",
    "REPAIR helps only the naive path.",
    "The two-core full, 8.2 %, lies inside the one-core run's interval over seeds.",
    "On the first ten pairs three of five means fell inside and two outside.",
    "Every barrier comes out higher than under patience 4.",
    "The learned midpoint is far better than weight matching's.",
    "The merged model stays worse than either endpoint.",
    "No merged model here is as good as the models it merges.",
    "Longer learning reduces the barrier by a quarter.",
    "After the learned method REPAIR raises the barrier.",
    "Full alignment lowers them to a quarter of naive.",
    "Training longer improves every barrier.",
    "The learned alignment is lowest everywhere.",
    "The full method's start leaves 3.9 points more on GPT-2.",
    "Every paired interval covers zero.",
    "Activation matching is not shown to leave less than weight matching.",
    "These runs cannot tell the two starts apart.",
    "The full model's 8.7 % misses the issue's goal of 4 %.",
    "Our byte-level models stay far from their 10 %.",
    "The naive barrier doubled from one trajectory to the next.",
    "Each trajectory moves the means by up to 16 points.",
    "What the symmetry leaves went from 0.004 to 0.020 nats.",
    "Variant 1 does not lower the naive barrier.",
    "The run before was consistent with the paper's range.",
])
def test_an_outcome_the_widened_phrases_catch(outcomes, sentence):
  assert OUTCOME.search(sentence), sentence
  assert unsupported(sentence, outcomes) == [sentence]


@pytest.mark.parametrize("sentence", [
    "Every setting runs on one CPU core, so that its numbers do not depend on the core count.",
    "The seeds stopped after 800-1,100 steps, 4 validations without a 0.2 % improvement.",
    "The head count stays at 4 and the head dimension grows with the width (8, 16, 32).",
    "`tests/test_reproduce.py` reruns the reduced `table1_vit_mnist_ape`.",
    "The table below gives each method's loss barrier over the ten pairs.",
    "Not run: widths above 128, and data sizes beyond the training split.",
    "Its reports go to `results/NAME/every_core/`, beside the one-core run's.",
    "The learned method trains the attention matrices and starts from the full method's element.",
    "No Variants 1 and 2 and no 24-permutation ablation, as for GPT-2.",
    "Earlier runs of this setting, at other commits, were replaced by the ten-seed run.",
    "The margin of the control's verdict was fixed before the run: 0.02 nats.",
])
def test_how_the_runs_were_made_is_no_outcome(sentence):
  assert not OUTCOME.search(sentence), OUTCOME.search(sentence)


# A figure the hand-written text gives with an interval: "71.6 % [60.6, 82.7]", "−6.02 [−24.44,
# 12.40]", or an interval alone. Its estimate and interval (to the printed digit) are those of
# one statistic of a committed results.json (a mean or estimate beside its interval), or stand
# on one line of a committed summary.md or of a generated block (which the generator wrote from
# those files). A figure without an interval is not checked: a bare "11.2 %" matches some
# committed number almost whatever it is.
NUMBER = r"[−+-]?\d+(?:,\d{3})*(?:\.\d+)?"
INTERVAL = re.compile(rf"\[({NUMBER}), ({NUMBER})\]")
ESTIMATE = re.compile(
    rf"(?<![\w.,−+-])({NUMBER})(?: %| points| nats| bits)? \[({NUMBER}), ({NUMBER})\]")


def _value(figure: str) -> float:
  return float(figure.replace("−", "-").replace(",", ""))


def _same(figure: str, value: float) -> bool:
  """Whether ``value`` prints as ``figure`` (to the digits ``figure`` has)."""
  digits = len(figure.split(".")[1]) if "." in figure else 0
  return abs(value - _value(figure)) <= 0.5 * 10 ** -digits + 1e-9


def committed_figures(results_root: str, generated: str) -> tuple[set, set]:
  """The intervals (low, high) and the estimates with their intervals (estimate, low, high) of
  the committed runs under ``results_root`` and of the generated blocks ``generated``."""
  intervals, estimates = set(), set()

  def walk(tree):
    if isinstance(tree, dict):
      numbers = [v for v in tree.values() if isinstance(v, (int, float))
                 and not isinstance(v, bool)]
      pairs = [tuple(v) for v in tree.values() if isinstance(v, list) and len(v) == 2
               and all(isinstance(u, (int, float)) for u in v)]
      intervals.update(pairs)
      estimates.update((n, *p) for n in numbers for p in pairs)
      for key, v in tree.items():
        if key != "pairs":  # each pair's curves and barriers: no interval there
          walk(v)
    elif isinstance(tree, list):
      for v in tree:
        walk(v)

  texts = [generated]
  for path in glob.glob(os.path.join(results_root, "**", "*"), recursive=True):
    if path.endswith(".json"):
      with open(path, encoding="utf-8") as f:
        walk(json.load(f))
    elif path.endswith(".md") and os.path.basename(path) != "README.md":
      with open(path, encoding="utf-8") as f:
        texts.append(f.read())
  for text in texts:
    for line in text.splitlines():
      numbers = [(m.start(), _value(m.group())) for m in re.finditer(NUMBER, line)]
      for m in INTERVAL.finditer(line):
        interval = (_value(m.group(1)), _value(m.group(2)))
        intervals.add(interval)
        estimates.update((n, *interval) for at, n in numbers if at < m.start())
  return intervals, estimates


def unchecked_figures(text: str, figures: tuple[set, set]) -> list[str]:
  """The figures with an interval in the hand-written text of ``text`` (its tables included)
  that no committed statistic (``committed_figures``) prints as."""
  intervals, estimates = figures
  flat = " ".join(generated_blocks(text)[0].split())
  bad = [m.group() for m in INTERVAL.finditer(flat)
         if not any(_same(m.group(1), lo) and _same(m.group(2), hi) for lo, hi in intervals)]
  bad += [m.group() for m in ESTIMATE.finditer(flat)
          if not any(_same(m.group(1), e) and _same(m.group(2), lo) and _same(m.group(3), hi)
                     for e, lo, hi in estimates)]
  return bad


@pytest.fixture(scope="module")
def readme_and_figures():
  with open(README, encoding="utf-8") as f:
    text = f.read()
  return text, committed_figures(committed.RESULTS_ROOT, generated_blocks(text)[1])


def test_every_interval_the_readme_gives_by_hand_is_a_committed_one(readme_and_figures):
  text, figures = readme_and_figures
  assert unchecked_figures(text, figures) == []


@pytest.mark.parametrize("sentence, caught", [
    # a run results/ no longer holds: the five-seed table1_vit_mnist_ape
    ("Full was 15.8 % [-10.7, 42.3] over five seeds.",
     ["[-10.7, 42.3]", "15.8 % [-10.7, 42.3]"]),
    # a committed interval beside an estimate it does not print as (-42.654 prints as -42.7)
    ("REPAIR − none is −42.6 points [−63.7, −21.7] in the first layer.",
     ["−42.6 points [−63.7, −21.7]"]),
    ("The learned method leaves 8.7 % [4.3, 13.2] on the full model.", []),
    ("Activation − full is −6.02 [−24.44, 12.40] on the full model.", []),
])
def test_a_figure_no_committed_run_gives_is_caught(readme_and_figures, sentence, caught):
  text, figures = readme_and_figures
  assert unchecked_figures(text + "\n\n" + sentence + "\n", figures) == caught
