nvidia-smi --query-gpu=name --format=csv,noheader
timeout 560 bash benchmarks/gpu_suite.sh tests $OUT 2>&1 | tail -25
