python3 -c "import tarfile; tarfile.open('.gpu.tar.xz').extractall('.')"
G=$PWD/.gpu; TL=$(python3 -c 'import torch, os; print(os.path.dirname(torch.__file__))')/lib
export LD_LIBRARY_PATH=$TL:$G/lib GDR_TORCH_LIB=$TL
BENCH=0 bash $G/run_all.sh > $OUT/tests_summary.txt 2>&1; tail -1 $OUT/tests_summary.txt
grep -E "^=== .*(PASSED|FAILED)|Failure$|error:|Which is|differs" $OUT/gpu_tests.log | head -40
(cd $G/bench/cross_entropy_bench && timeout 90 ./cross_entropy_bench) > $OUT/ce_bench.txt 2>&1; head -30 $OUT/ce_bench.txt
(cd $G/bench/qwen_step_bench && timeout 120 ./qwen_step_bench --arms=gate) > $OUT/step_bench.txt 2>&1; head -34 $OUT/step_bench.txt
cd $G/bench/step_timing && STEP_TIMING=./step_timing timeout 200 bash $G/step_timing_paired.sh 2 "--set=model.deterministic_mode=false" "--set=model.deterministic_mode=true" --config=configs/train_qwen0p8b.yaml --warmup=5 --steps=30 2>&1 | tail -6
cd $G/tools/train_cuda && TRAIN=./train_cuda LAUNCH=$G/launch.sh timeout 150 bash $G/dp_scaling.sh configs/train_qwen0p8b.yaml 30 --set=train.grad_accum=4 2>&1 | grep "median\|/ DP"
