# One kernel, or one kernel question, timed on its own: launch-config sweeps and probes as
# CUDA-graph replays over operands beyond the L2, written to $OUT/NAME.json (a console log for
# qk-compile-diag). From the repo root on the GPU host, after
#   export ORCHESTRATE_CODE_SHA=<sha>; source benchmarks/device_setup.sh
#   bash benchmarks/kernel_sweeps.sh MODE [NAME]
# NAME defaults to the committed record's name (benchmarks/README.md quotes each record with its
# mode and commit); SWEEP_S overrides the mode's time limit.
#   gemv             benchmarks/gemv_sweep.py: INT8 GEMV configs at Rumik's two decode shapes
#                                                         -> issue14-gemv-sweep
#   gemv-pdl         the same, every launch with PDL       -> issue14-gemv-sweep-pdl
#   gemv-tma         the shipped config, the pdl_tuned table's and the TMA kernel's candidates,
#                    with PDL, three interleaved passes    -> issue14-gemv-sweep-tma
#   l2-prefetch      benchmarks/gemv_l2_prefetch_probe.py: the o+down weight pulled into the L2
#                    during the glue                       -> issue14-l2-prefetch-probe
#   ov-gemm          benchmarks/ov_gemm_sweep.py: small_gemm's configs against cuBLAS (and
#                    cuBLASLt) at OmniVoice's four GEMM shapes; writes
#                    $OUT/ov-best-packed-gemm.yaml where a config wins by --min-gain
#                                                         -> issue14-ov-gemm-sweep
#   ov-qkv-warps     benchmarks/ov_qkv_warps.py: the fused q/k/v kernel at 1-16 warps
#                                                         -> issue14-ov-qkv-warps
#   ov-fp8-attn      benchmarks/ov_probe_fp8_attn.py: FP8 GEMMs and SDPA back ends at
#                    OmniVoice's shapes                    -> issue14-ov-fp8-attn-probe
#   qk-compile-diag  benchmarks/qk_compile_diag.py: the fused q/k/v op compiled against eager
#                                                         -> issue14-qk-compile-diag.log
set -o pipefail
mode=$1
quiet() { grep -v "Warning\|warn" | tail -"$1"; }
case "$mode" in
gemv)
    timeout "${SWEEP_S:-150}" python3 benchmarks/gemv_sweep.py \
        --out "$OUT/${2:-issue14-gemv-sweep}.json" ;;
gemv-pdl)
    timeout "${SWEEP_S:-150}" python3 benchmarks/gemv_sweep.py --pdl \
        --out "$OUT/${2:-issue14-gemv-sweep-pdl}.json" ;;
gemv-tma)
    timeout "${SWEEP_S:-200}" python3 benchmarks/gemv_sweep.py --tma --pdl --repeats 3 \
        --out "$OUT/${2:-issue14-gemv-sweep-tma}.json" 2>&1 | quiet 16 ;;
l2-prefetch)
    timeout "${SWEEP_S:-150}" python3 benchmarks/gemv_l2_prefetch_probe.py \
        --out "$OUT/${2:-issue14-l2-prefetch-probe}.json" 2>&1 | quiet 14 ;;
ov-gemm)
    timeout "${SWEEP_S:-400}" python3 benchmarks/ov_gemm_sweep.py \
        --out "$OUT/${2:-issue14-ov-gemm-sweep}.json" --stack-out "$OUT/ov-best-packed-gemm.yaml" \
        2>&1 | quiet 44 ;;
ov-qkv-warps)
    timeout "${SWEEP_S:-60}" python3 benchmarks/ov_qkv_warps.py \
        --out "$OUT/${2:-issue14-ov-qkv-warps}.json" 2>&1 | grep -v "Warning\|warn" ;;
ov-fp8-attn)
    timeout "${SWEEP_S:-150}" python3 benchmarks/ov_probe_fp8_attn.py \
        --out "$OUT/${2:-issue14-ov-fp8-attn-probe}.json" 2>&1 | quiet 20 ;;
qk-compile-diag)
    timeout "${SWEEP_S:-120}" python3 benchmarks/qk_compile_diag.py 2>&1 \
        | tee "$OUT/${2:-issue14-qk-compile-diag}.log" | grep "reset=" ;;
*) echo "usage: kernel_sweeps.sh MODE [NAME]; the modes are listed at the top of benchmarks/kernel_sweeps.sh" >&2
   exit 2 ;;
esac
