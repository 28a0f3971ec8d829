"""Builds (once, cached outside the repo) and installs Horovod 0.28.1 for the pinned TensorFlow.

    python tools/install_horovod.py            # into the running interpreter's environment

Gloo always; NCCL GPU operations when nvcc and nccl.h are found; MPI when mpicc is found.
Horovod 0.28.1 needs source changes to build against TensorFlow 2.21, applied here to the
unpacked sdist (each is idempotent):
  - leave horovod/tensorflow/xla_mpi_ops.cc (opt-in XLA custom calls) out of the build: it
    includes highwayhash headers TF 2.21 no longer ships;
  - GPU builds: TF 2.21 no longer exports stream_executor::gpu::AsGpuStreamValue, use
    Stream::platform_specific_handle().stream; compile Horovod's CUDA kernels as C++17.
The wheel is kept in $TF_SOK_CACHE/wheels (default ~/.cache/tf_sok/wheels), keyed by the Python
and TensorFlow versions, so re-installs do not rebuild.
"""
import glob
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile

VERSION = "0.28.1"


def _edit(path, fn):
    with open(path) as f:
        s = f.read()
    t = fn(s)
    if t != s:
        with open(path, "w") as f:
            f.write(t)


def _gpu_stream(s):
    old = ("// Forward declaration of AsGpuStreamValue\nnamespace stream_executor {\nnamespace gpu {\n"
           "GpuStreamHandle AsGpuStreamValue(Stream* stream);\n} // namespace stream_executor\n} // namespace gpu\n")
    s = s.replace(old, "#define HVD_TF_GPU_STREAM(s) "
                       "(static_cast<GpuStreamHandle>((s)->platform_specific_handle().stream))\n")
    return re.sub(r"stream_executor::gpu::AsGpuStreamValue\(", "HVD_TF_GPU_STREAM(", s)


def patch(src):
    _edit(os.path.join(src, "horovod/tensorflow/CMakeLists.txt"),
          lambda s: s.replace('list(APPEND TF_SOURCES "${PROJECT_SOURCE_DIR}/horovod/tensorflow/xla_mpi_ops.cc")\n', ""))
    _edit(os.path.join(src, "horovod/tensorflow/mpi_ops.cc"), _gpu_stream)
    _edit(os.path.join(src, "horovod/common/ops/cuda/CMakeLists.txt"),
          lambda s: s.replace("set(CMAKE_CUDA_STANDARD 11)", "set(CMAKE_CUDA_STANDARD 17)"))


def build_env():
    env = dict(os.environ, HOROVOD_WITH_TENSORFLOW="1", HOROVOD_WITH_GLOO="1", HOROVOD_WITHOUT_PYTORCH="1",
               HOROVOD_WITHOUT_MXNET="1", MAKEFLAGS=f"-j{os.cpu_count() or 2}")
    if os.path.exists("/usr/bin/cmake"):
        env["HOROVOD_CMAKE"] = "/usr/bin/cmake"  # cmake 4.x from pip breaks Horovod's bundled Gloo
    env.setdefault("CMAKE_POLICY_VERSION_MINIMUM", "3.5")
    if not shutil.which("mpicc"):
        env["HOROVOD_WITHOUT_MPI"] = "1"
    nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None)
    nccl = [p for p in ("/usr/include/nccl.h", "/usr/local/cuda/include/nccl.h") if os.path.exists(p)]
    if nvcc and nccl and os.environ.get("TF_SOK_HOROVOD_NCCL", "auto") != "0":
        env.update(HOROVOD_GPU_OPERATIONS="NCCL", HOROVOD_CUDA_HOME=os.path.dirname(os.path.dirname(nvcc)),
                   HOROVOD_NCCL_LINK="SHARED")
    return env


def main():
    import tensorflow as tf

    cache = os.environ.get("TF_SOK_CACHE", os.path.expanduser("~/.cache/tf_sok"))
    py = f"cp{sys.version_info.major}{sys.version_info.minor}"
    wheel_dir = os.path.join(cache, "wheels", f"horovod-{VERSION}-tf{tf.__version__}-{py}")
    wheels = glob.glob(os.path.join(wheel_dir, f"horovod-{VERSION}-*.whl"))
    if not wheels:
        os.makedirs(wheel_dir, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                            f"horovod=={VERSION}", "-d", tmp], check=True)
            with tarfile.open(glob.glob(os.path.join(tmp, "horovod-*.tar.gz"))[0]) as t:
                t.extractall(tmp)
            src = os.path.join(tmp, f"horovod-{VERSION}")
            patch(src)
            print(f"building Horovod {VERSION} against TensorFlow {tf.__version__} (several minutes)", flush=True)
            subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-build-isolation", "--no-deps",
                            "-w", wheel_dir, src], check=True, env=build_env())
        wheels = glob.glob(os.path.join(wheel_dir, f"horovod-{VERSION}-*.whl"))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall", wheels[0]],
                   check=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "cloudpickle", "psutil", "pyyaml", "packaging"],
                   check=True)
    print("installed", os.path.basename(wheels[0]))


if __name__ == "__main__":
    main()
