# Two jobs at once on the two GPUs of one host (device kind nvidia-h200-x2): GPU 0 resumes the
# en20 headline at the commit it began at, GPU 1 runs a command of this checkout. From the repo
# root on the GPU host, after
#   export ORCHESTRATE_CODE_SHA=<this checkout's sha>; source benchmarks/device_setup.sh
#   bash benchmarks/two_gpus.sh <en20's sha> -- <command for GPU 1>
# With no command after `--` (a one-GPU host, kind nvidia-h200), en20 runs alone on GPU 0 with
# every core, and still carries its compile caches from call to call.
# Carried in .en20/: code.tgz (`git archive <en20's sha> | gzip`), en20-state.tgz (the last
# call's) and, if there is one, en20-cache.tgz (its Inductor and Triton caches).
# The en20 commit is installed apart, in /tmp/en20site (not editable), and its job runs from its
# own tree: one process never sees the other's `orchestrate`, and a resume still meets the code
# it began with (it refuses any other). Each job gets its own half of the host's cores, so one's
# Python launch loop never waits for the other's compiles; the en20 record says it ran beside
# another job (benchmarks/README.md) all the same.
# $OUT returns at most 8 files, so each job writes to its own folder, packed into one file here.
set -o pipefail
en20_sha=$1; shift
[ "$1" = "--" ] && shift
root=$PWD
half=$(( $(nproc) / 2 ))
[ $# -eq 0 ] && half=$(nproc)  # en20 alone: all cores are its own
pin() { if command -v taskset > /dev/null; then taskset -c "$1" "${@:2}"; else "${@:2}"; fi; }
mkdir -p /tmp/out-en20 /tmp/out-gpu1 /tmp/c20
rm -rf /tmp/en20site && tar xzf .en20/code.tgz -C /tmp/c20 || exit 1
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile \
    --target /tmp/en20site /tmp/c20 > /tmp/out-en20/install.log 2>&1 || exit 1
rm -rf /tmp/c20/build /tmp/c20/orchestrate.egg-info  # only /tmp/en20site's metadata counts
ln -s /tmp/c20/configs /tmp/en20site/configs  # REPO_ROOT is the package's grandparent
ln -s /tmp/c20/experiments /tmp/en20site/experiments
[ -f .en20/en20-cache.tgz ] && tar xzf .en20/en20-cache.tgz -C /tmp

(
    cd /tmp/c20 || exit 1
    export CUDA_VISIBLE_DEVICES=0 PYTHONPATH=/tmp/en20site:$PYTHONPATH OUT=/tmp/out-en20
    export ORCHESTRATE_CODE_SHA=$en20_sha EN20_CARRIED=$root/.en20/en20-state.tgz
    export TORCHINDUCTOR_CACHE_DIR=/tmp/en20cache/inductor TRITON_CACHE_DIR=/tmp/en20cache/triton
    python3 -c "
import orchestrate.api.config as c
assert str(c.REPO_ROOT) == '/tmp/en20site', f'en20 would import {c.REPO_ROOT}'
print('en20 code:', c.REPO_ROOT)" || exit 1
    EN20_BUDGET_S=${EN20_BUDGET_S:-520} pin "0-$((half - 1))" bash benchmarks/en20_headline.sh
) > /tmp/out-en20/console.log 2>&1 &
en20=$!
if [ $# -gt 0 ]; then
    (
        export CUDA_VISIBLE_DEVICES=1 OUT=/tmp/out-gpu1
        pin "$half-$((2 * half - 1))" timeout "${GPU1_BUDGET_S:-530}" "$@"
    ) > /tmp/out-gpu1/console.log 2>&1 &
    gpu1=$!
fi
wait $en20; echo "en20 job: exit $?"
[ -n "$gpu1" ] && { wait $gpu1; echo "GPU 1 job: exit $?"; }

mv /tmp/out-en20/en20-state.tgz "$OUT/" 2>/dev/null
tar czf "$OUT/en20-cache.tgz" -C /tmp en20cache 2>/dev/null
tar czf "$OUT/en20-out.tgz" -C /tmp out-en20
echo "== en20 (GPU 0)"; tail -20 /tmp/out-en20/console.log
[ -n "$gpu1" ] || exit 0
tar czf "$OUT/gpu1-out.tgz" -C /tmp out-gpu1
echo "== GPU 1"; tail -40 /tmp/out-gpu1/console.log
