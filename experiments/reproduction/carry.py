"""What travels with the working tree to a GPU machine that has no network: the data and wheels.

``experiments/accelerator_sweep.py --prepare`` fills ``CARRY_DIR`` (ignored by git,
named in the device call's ``carry``) on a machine with a network:

    .accelerator/data/wiki_bytes/...   the prepared Wikipedia bytes (TFDS array_record
                                       files, 3.3 MB), read there through
                                       ``$ATTN_SYMMETRY_DATA_DIR`` (``data.DATA_DIR_ENV``)
    .accelerator/wheels/*.whl          ``WHEELS``, for CPython 3.12 on x86-64 Linux

The GPU image has JAX with CUDA, Flax, Optax, Orbax, matplotlib and scikit-learn
(``IMAGE_PACKAGES``: its package list as read on 2026-11-17), but not the
experiments extra's input pipeline and config packages: ``WHEELS`` are those that
``experiments/`` imports or that they declare as requirements, and no more, each at
the version this checkout is tested with (the one installed where ``--prepare``
runs). The machine installs them with ``install_command``.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys

from experiments.reproduction import runner

CARRY_DIR = os.path.join(runner.REPO, ".accelerator")
DATA_DIR = os.path.join(CARRY_DIR, "data")
WHEEL_DIR = os.path.join(CARRY_DIR, "wheels")
DATASET = "wiki_bytes"  # the only data set of the accelerator settings

# Python packages of the GPU machines' image (names as pip normalises them), read there.
IMAGE_PACKAGES = frozenset("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch
build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage
cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn
einops equinox etils execnet filelock flatbuffers flax fonttools formulaic frozenlist fsspec
gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna imageio
iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib
kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml
markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack
multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda
numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse
nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13
nvidia-nvtx onnx onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum
opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft pillow pip
pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo
pygments pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov
pytest-mock pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex
requests rich sacrebleu safetensors scikit-build-core scikit-image scikit-learn scipy seaborn
sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers
statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl
tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics
torchvision tqdm transformers treescope triton typer typing-extensions typing-inspect urllib3
uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp
""".split())

# The distributions that experiments/ needs and the image lacks: what imports each.
WHEELS = {
    "tensorflow-datasets": "attn_symmetry.data (the TFDS builders, read without TensorFlow)",
    "array-record": "tensorflow-datasets and grain (the prepared files' format)",
    "dm-tree": "tensorflow-datasets",
    "immutabledict": "tensorflow-datasets",
    "promise": "tensorflow-datasets (a source distribution: built into a wheel here)",
    "simple-parsing": "tensorflow-datasets",
    "docstring-parser": "simple-parsing",
    "tensorflow-metadata": "tensorflow-datasets",
    "googleapis-common-protos": "tensorflow-metadata",
    "termcolor": "tensorflow-datasets",
    "toml": "tensorflow-datasets",
    "importlib-resources": "etils[epath] (tensorflow-datasets' file paths)",
    "grain": "attn_symmetry.data (the readers)",
    "portpicker": "grain",
    "ml-collections": "experiments/ (the configs)",
    "tensorboardx": "experiments/train/metric_writers.py",
}
# Imported where installed, and left out without harm (flax.nnx's optional notebook display).
OPTIONAL = frozenset({"ipython", "traitlets"})

_PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
              "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64")
PYTHON_VERSION = "3.12"  # the GPU image's python3


def normalise(name: str) -> str:
  """A distribution name as pip compares them: lower case, runs of -_. as one '-'."""
  out = name.lower()
  for sep in "_.":
    out = out.replace(sep, "-")
  return out


def pinned() -> list[str]:
  """``WHEELS`` as NAME==VERSION, at the versions installed here.

  Raises:
    ValueError: one of them is not installed here (install the experiments extra).
  """
  out = []
  for name in WHEELS:
    try:
      out.append(f"{name}=={importlib.metadata.version(name)}")
    except importlib.metadata.PackageNotFoundError as e:
      raise ValueError(f"{name} is not installed here; --prepare pins the wheels it carries to "
                       "this checkout's versions: pip install -e '.[experiments]'") from e
  return out


def outside(distributions) -> list[str]:
  """Those of ``distributions`` that the GPU machine would lack: neither in the image, nor
  carried, nor optional (``attn-symmetry`` itself travels as source)."""
  have = IMAGE_PACKAGES | set(WHEELS) | OPTIONAL | {"attn-symmetry"}
  return sorted({normalise(d) for d in distributions} - have)


def imported_distributions() -> list[str]:
  """The distributions of every module this process has imported."""
  owners = importlib.metadata.packages_distributions()
  return sorted({d for m in list(sys.modules) for d in owners.get(m.partition(".")[0], ())})


def prepare_data(data_dir: str = DATA_DIR) -> str:
  """Prepares ``DATASET`` into ``data_dir`` (offline: from gensim's test data) and returns
  its folder."""
  from attn_symmetry import data  # pylint: disable=g-import-not-at-top  (the experiments extra)
  os.makedirs(data_dir, exist_ok=True)
  data.prepare_dataset(DATASET, data_dir)
  return os.path.join(data_dir, DATASET)


def prepare_wheels(wheel_dir: str = WHEEL_DIR) -> list[str]:
  """Downloads ``WHEELS`` (``pinned``) for CPython ``PYTHON_VERSION`` on x86-64 Linux into
  ``wheel_dir``, replacing what it held, building a wheel where PyPI has only a source
  distribution; returns the files.

  Raises:
    subprocess.CalledProcessError: pip failed (it needs a network).
  """
  shutil.rmtree(wheel_dir, ignore_errors=True)
  os.makedirs(wheel_dir)
  pip = [sys.executable, "-m", "pip"]
  binary, source = [], []
  for pin in pinned():
    (source if pin.startswith("promise==") else binary).append(pin)
  subprocess.run([*pip, "download", "--no-deps", "--only-binary=:all:", "--python-version",
                  PYTHON_VERSION, "--implementation", "cp",
                  *(f"--platform={p}" for p in _PLATFORMS), "-d", wheel_dir, *binary], check=True)
  if source:  # pure Python: the wheel built here installs on any CPython 3
    subprocess.run([*pip, "wheel", "--no-deps", "-w", wheel_dir, *source], check=True)
  return sorted(os.path.join(wheel_dir, f) for f in os.listdir(wheel_dir))


def folder_bytes(path: str) -> int:
  """The bytes of every file under ``path`` (0 if it does not exist)."""
  return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def install_command(site: str = "/tmp/site") -> str:
  """The shell command that installs the carried wheels on the GPU machine (into ``site``,
  put on ``PYTHONPATH`` with the checkout) and stops the call if it fails."""
  wheels = os.path.relpath(WHEEL_DIR, runner.REPO)
  return (f"python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir "
          f"--upgrade --target {site} {wheels}/*.whl && export PYTHONPATH={site}:$PWD || exit")
