"""Builds tf_sok: the Python package plus ONE op library, _tf_sok_ops.

The op library holds the C++ CPU kernels always and the CUDA kernels whenever
nvcc is found. Knobs (environment):
  TF_SOK_CUDA=auto|0|1        build the CUDA kernels (auto: when nvcc is found)
  TF_SOK_CUDA_ARCHS="80;90"   SM architectures for nvcc (PTX of the last is kept too)
  TF_SOK_NVCC=/path/to/nvcc   nvcc to use (default: $CUDA_HOME/bin/nvcc, then PATH)
  TF_SOK_JOBS=N               parallel compile jobs (default: CPU count)
Objects are cached under build/tf_sok_obj keyed by their source, headers and
flags, so a rebuild compiles only what changed.
"""
import concurrent.futures
import glob
import hashlib
import os
import shutil
import subprocess

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))
CC_DIR = os.path.join("tf_sok", "cc")
LIB_NAME = "tf_sok.lib._tf_sok_ops"


def _requirements():
    with open(os.path.join(ROOT, "requirements.txt")) as f:
        return [l.strip() for l in f if l.strip() and not l.startswith("#")]


def _find_nvcc():
    explicit = os.environ.get("TF_SOK_NVCC")
    if explicit:
        return explicit
    home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    cand = os.path.join(home, "bin", "nvcc")
    return cand if os.path.exists(cand) else shutil.which("nvcc")


def _want_cuda():
    mode = os.environ.get("TF_SOK_CUDA", "auto").lower()
    nvcc = _find_nvcc()
    if mode in ("0", "off", "false", "no"):
        return None
    if mode in ("1", "on", "true", "yes"):
        if not nvcc:
            raise RuntimeError("TF_SOK_CUDA=1 but nvcc was not found (set TF_SOK_NVCC or CUDA_HOME)")
        return nvcc
    return nvcc


class BuildOps(build_ext):
    """Compiles tf_sok/cc/**/*.cc with g++ and **/*.cu with nvcc, links one .so."""

    def build_extension(self, ext):
        import tensorflow as tf  # build-time dependency (pip install --no-build-isolation)

        tf_cflags = tf.sysconfig.get_compile_flags()
        tf_lflags = tf.sysconfig.get_link_flags()
        nvcc = _want_cuda()
        cuda_home = os.path.dirname(os.path.dirname(os.path.realpath(nvcc))) if nvcc else None
        archs = [a for a in os.environ.get("TF_SOK_CUDA_ARCHS", "80;90").replace(",", ";").split(";") if a]
        defs = ["-DTF_SOK_WITH_CUDA=%d" % (1 if nvcc else 0)]
        build_defs = ['-DTF_SOK_BUILT_TF_VERSION="%s"' % tf.__version__,
                      '-DTF_SOK_BUILT_CUDA_ARCHS="%s"' % (",".join(archs) if nvcc else "")]
        cxx = os.environ.get("CXX", "g++")
        cxxflags = [*tf_cflags, *defs, *build_defs, "-I" + ROOT, "-O3", "-fno-math-errno", "-fPIC", "-Wall",
                    "-Wno-deprecated-declarations", "-Wno-interference-size", "-Wno-sign-compare", "-Wno-unused-function"]
        if cuda_home:
            cxxflags.append("-I" + os.path.join(cuda_home, "include"))
        sources = sorted(glob.glob(os.path.join(CC_DIR, "**", "*.cc"), recursive=True))
        cu_sources = sorted(glob.glob(os.path.join(CC_DIR, "**", "*.cu"), recursive=True)) if nvcc else []
        nvflags = ["-std=c++17", "-O3", "-Xcompiler", "-fPIC", "-I" + ROOT, *defs,
                   "--expt-relaxed-constexpr", "-lineinfo"]
        for a in archs:
            nvflags += ["-gencode", "arch=compute_%s,code=sm_%s" % (a, a)]
        if archs:
            nvflags += ["-gencode", "arch=compute_%s,code=compute_%s" % (archs[-1], archs[-1])]
        headers = sorted(glob.glob(os.path.join(CC_DIR, "**", "*.h"), recursive=True)) + \
            sorted(glob.glob(os.path.join(CC_DIR, "**", "*.cuh"), recursive=True))
        header_digest = hashlib.sha256()
        for h in headers:
            with open(h, "rb") as f:
                header_digest.update(h.encode() + f.read())
        obj_dir = os.path.join(ROOT, "build", "tf_sok_obj")
        os.makedirs(obj_dir, exist_ok=True)

        def compile_one(src, compiler, flags):
            with open(src, "rb") as f:
                key = hashlib.sha256(f.read() + header_digest.digest() +
                                     " ".join([compiler, *flags, tf.__version__]).encode()).hexdigest()[:16]
            obj = os.path.join(obj_dir, "%s.%s.o" % (src.replace(os.sep, "_"), key))
            if not os.path.exists(obj):
                cmd = [compiler, *flags, "-c", src, "-o", obj + ".tmp"]
                print("compiling", src, flush=True)
                subprocess.run(cmd, check=True, cwd=ROOT)
                os.replace(obj + ".tmp", obj)
            return obj

        jobs = int(os.environ.get("TF_SOK_JOBS", os.cpu_count() or 1))
        with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
            # nvcc units are the slowest: start them first.
            futs = [pool.submit(compile_one, s, nvcc, nvflags) for s in cu_sources]
            futs += [pool.submit(compile_one, s, cxx, ["-std=c++17", *cxxflags]) for s in sources]
            objs = [f.result() for f in futs]

        out = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(out), exist_ok=True)
        link = [cxx, "-shared", "-o", out, *objs]
        if nvcc:
            # cudart static and BEFORE TensorFlow's flags: libtensorflow_framework
            # carries a CUDA stub the linker would otherwise bind to.
            link += ["-L" + os.path.join(cuda_home, "lib64"), "-l:libcudart_static.a",
                     "-Wl,--exclude-libs,libcudart_static.a", "-ldl", "-lrt", "-lpthread"]
        link += tf_lflags
        print("linking", out, flush=True)
        subprocess.run(link, check=True, cwd=ROOT)


setup(
    name="tf_sok",
    version="0.1.0",
    description="Sparse embedding plugin for TensorFlow/Keras: fused lookups, sharded tables, sparse optimizers",
    packages=find_packages(include=["tf_sok", "tf_sok.*"]),
    ext_modules=[Extension(LIB_NAME, sources=[])],
    cmdclass={"build_ext": BuildOps},
    install_requires=_requirements(),
    python_requires=">=3.9",
)
