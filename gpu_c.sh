timeout 500 bash benchmarks/gpu_suite.sh e2e-fit $OUT DLRM:10 DLRM-tier:10 DLRM-tier-prefetch:10 2>&1 | tail -30
