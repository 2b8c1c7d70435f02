# The job queue on one GPU host: stock, baseline-b and exp74-full submitted as three jobs
# (each against stock on gpu-pool), drained by `orchestrate workers --gpus all
# --exit-when-idle`; the record (benchmarks/pool_record.py) says where each job ran, its model
# build (the warm worker's second and third jobs reuse the model: seconds saved), and the
# pool's wall time against the sum of the jobs' times. From the repo root on the GPU host:
#   export ORCHESTRATE_CODE_SHA=<sha>; source benchmarks/device_setup.sh
#   bash benchmarks/pool_one_gpu.sh            (writes $OUT/pool-one-gpu.json and .log)
set -o pipefail
db=sqlite:////tmp/pool.db
rm -f /tmp/pool.db*
for stack in stock baseline-b exp74-full; do
    python3 -m orchestrate.cli submit --stack "$stack" --model rumik-oss-1 --device cuda \
        --workload gpu-pool --db "$db" --runs-dir /tmp/pool-runs || exit 1
done
python3 -m orchestrate.cli queue --db "$db"
python3 -m orchestrate.cli workers --gpus all --exit-when-idle --no-mlflow --db "$db" \
    --runs-dir /tmp/pool-runs 2>&1 | tee "$OUT/pool-one-gpu.log"
python3 -m orchestrate.cli queue --db "$db" | tee -a "$OUT/pool-one-gpu.log"
python3 benchmarks/pool_record.py --db "$db" --out "$OUT/pool-one-gpu.json"
