# tf_sok: `make demo` trains the DLRM example, `make test` runs the test suite.
# Both create .venv, install the pinned dependencies and build the op library
# (CUDA kernels too when nvcc is found; TF_SOK_CUDA=0 to skip them).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
DEPS   := $(VENV)/.deps-installed
HVD    := $(VENV)/.horovod-installed

.PHONY: all build demo demo-horovod demo-mirrored test test-gpu bench clean

all: build

$(DEPS): requirements.txt requirements-dev.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip "setuptools>=69" wheel
	$(BIN)/python -m pip install -q -r requirements-dev.txt
	touch $@

# Horovod 0.28.1 built against the pinned TensorFlow (Gloo; NCCL/MPI when found).
# The wheel is cached in ~/.cache/tf_sok/wheels, so re-installs do not rebuild.
$(HVD): $(DEPS) tools/install_horovod.py
	$(BIN)/python tools/install_horovod.py
	touch $@

# Compiles only what changed (objects are cached under build/tf_sok_obj).
build: $(DEPS) $(HVD)
	$(BIN)/python -m pip install -q --no-build-isolation --no-deps -e .

demo: build
	$(BIN)/python examples/dlrm_synthetic.py

# The same model trained by 2 processes (tables sharded across them).
demo-horovod: build
	$(BIN)/horovodrun -np 2 -H localhost:2 --gloo $(BIN)/python examples/horovod_dlrm.py

# The same model under tf.distribute.MirroredStrategy (all GPUs, or 2 logical CPU devices).
demo-mirrored: build
	$(BIN)/python examples/mirrored_dlrm.py

test: build
	$(BIN)/python -m pytest -q --durations=15 tests

# GPU-marked tests only (they skip themselves where no GPU is visible).
test-gpu: build
	$(BIN)/python -m pytest -q -m gpu tests

bench: build
	$(BIN)/python benchmarks/lookup_bench.py

clean:
	rm -rf build tf_sok/lib/*.so *.egg-info
