#!/usr/bin/env bash
# The CUDA checks and GPU figures still owed (issue 14), as one prepared run for a GPU machine lent for a
# few minutes: each step runs under its own timeout, in the order given, while the deadline allows, and
# leaves its log in $OUT (the device tool's output folder; /tmp/device-checks elsewhere).
#
#   bash bench/device_checks.sh                      # the service bench (~8.5 min on an H100)
#   bash bench/device_checks.sh 250 unit             # a deadline and the steps to run, in order
#
# A session's device time (15 minutes, the machine's start included) fits the service step in one call,
# then short calls made at once while the machine is warm (it is given back after 30 s idle). On
# 2026-11-26 (one H100, 838 s held in all): `bash bench/device_checks.sh 570 service unit` (service 501 s,
# unit cut off), then `... 250 unit` (55 s: 15 passed), then `... 205 service-tests` (150 s: 2 passed).
# Later that day (one H100, 864 s held): `... 570` cut the service step at 520 s before its second run,
# then `... 285 unit service-tests` (unit 119 s; the second service test was cut at its 147 s). The
# service step now runs decode=cpu first (what the large-batch configs use) and one engine row fewer, but
# both runs still need about 700 s. On 2026-11-27 (one H100, 828 s held in all): `... 585 service-lean`
# (both decodes without profiles: 344 s), then at once `... 430 unit service-tests` (69 + 119 s), then two
# profiled steps by resuming the bench's run (/tmp/bench-gpu stays while the machine is warm): the plan
# for a 15-minute session. Give the machine back after the last call.
# Earlier that day on one H200: service 249 s (decode=gpu only), unit 106 s, data 30 s, service-tests
# 153 s, engine 71 s, and `bench/gpu.py --parts losses` 78 s.
#
# It installs .device-pack first when the machine lacks Ray (bash ../shared/tools/device_pack.sh
# .device-pack builds it here). Steps:
#   tests    pytest -m gpu: decode, engine precision/compile, streamed losses, prefetch, the GPU service runs
#   unit     the same without the two service runs (they start Ray and compile: minutes)
#   service-tests   only those two service runs
#   data     bench/data.py --quick: nvJPEG decode + batched crops against the per-image crops and PIL
#   service-cpu, service-gpu   the same with one data.decode: each fits one call with time to spare
#   service-lean   both decodes without the profiles and the engine-beside-decoders rows (bench/gpu.py --lean):
#            the goal's figures for both in one call (est. ~480 s on an H100)
#   service-share  as service-lean with data.decode=gpu and data.host_decode_share=$SHARE (default 0.3), then
#            data.decode=cpu: the two changes since 2026-11-27 not yet measured on a GPU (the loader workers
#            decoding a share of the JPEGs; the join straight into pinned memory)
#   service  bench/gpu.py --parts service, decode=cpu then gpu: img/s, data wait, phases, vs the engine
#            alone, beside the device decoder and beside PIL decoding processes; torch.profiler tables and
#            traces of one step of each (profile-*/), GPU utilisation and `top` samples (load-*)
#   engine   bench/gpu.py --parts engine at B = 1,024 and 8,192 (chunked, eager / channels_last / compiled)
# What comes back: summary.txt, machine.txt, each step's log (and JSON), extras.tgz (profile tables, each
# service run's own log, load samples) and traces-service.tgz / traces-engine.tgz (the Perfetto traces).
set -uo pipefail
deadline=$((SECONDS + ${1:-580}))
[ $# -gt 0 ] && shift
steps=("$@")
[ ${#steps[@]} -gt 0 ] || steps=(service)
out=${OUT:-/tmp/device-checks}
mkdir -p "$out" && : >"$out/summary.txt"
export RAY_USAGE_STATS_ENABLED=0 PYTHONUNBUFFERED=1
SHARE=${SHARE:-0.3}

# A later call on the still-warm machine is a fresh shell: the pack installed by an earlier one is in
# /tmp/site, but only on the path when put there again.
site() { export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PATH="/tmp/site/bin:$PATH"; }
[ -d /tmp/site ] && site
if ! python3 -c "import ray" 2>/dev/null && [ -x .device-pack/install.sh ]; then
  bash .device-pack/install.sh >"$out/install.log" 2>&1 || { echo "install failed: $out/install.log"; exit 1; }
  site
fi
python3 -c "import ray, mlflow, webdataset, pydantic" 2>/dev/null \
  || { echo "no device pack: build it (bash ../shared/tools/device_pack.sh .device-pack) and carry it"; exit 3; }
{ command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
  df -B1 --output=target,size,avail /dev/shm 2>/dev/null | tail -n 1  # the loaders' shared memory
  git log --oneline -1 2>/dev/null || true; } | tee "$out/machine.txt"

run() {  # run NAME SECONDS COMMAND...: within the deadline, logged, its exit status in the summary
  local name=$1 limit=$2; shift 2
  local left=$((deadline - SECONDS - 5))
  if [ "$left" -lt 30 ]; then echo "$name: not run, $left s left" | tee -a "$out/summary.txt"; return; fi
  [ "$limit" -gt "$left" ] && limit=$left
  local start=$SECONDS
  timeout -k 10 "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  local why=""
  [ $rc -eq 124 ] && why=", timed out"
  [ $rc -eq 137 ] && why=", killed (past the limit's grace, or out of memory)"
  { echo "$name: exit $rc in $((SECONDS - start)) s (limit $limit s$why)"
    echo "  last line: $(grep -v '^\s*$' "$out/$name.log" | tail -n 1 | cut -c1-300)"; } | tee -a "$out/summary.txt"
}

samplers=()
sample_load() {  # sample_load PREFIX: GPU utilisation every 0.5 s and the busiest processes every 5 s
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used,power.draw --format=csv -lms 500 \
      >"$1-gpu.csv" 2>&1 &
    samplers+=($!)
  fi
  top -b -d 5 -w 200 2>/dev/null | awk '/^top -/ {n = 0} n++ < 24 {print; fflush()}' >"$1-top.txt" &
  samplers+=($!)
}

gpu_tests=(tests/test_gpu.py tests/test_gpu_decode.py tests/test_losses_streamed.py tests/test_prefetch.py)
for step in "${steps[@]}"; do
  case $step in
    tests) run tests 420 python3 -m pytest -m gpu -rs -s -p no:cacheprovider "${gpu_tests[@]}" ;;
    unit) run unit 200 python3 -m pytest -m "gpu and not service" -rs -p no:cacheprovider "${gpu_tests[@]}" ;;
    service-tests) run service-tests 300 python3 -m pytest -m "gpu and service" -rs -s -p no:cacheprovider \
      "${gpu_tests[@]}" ;;
    data) run data 120 python3 bench/data.py --quick --gpu-batch 128 ;;
    service|service-cpu|service-gpu|service-lean|service-share) sample_load "$out/load"
      decodes=(cpu gpu) lean=() && [ "$step" != service ] && [ "$step" != service-lean ] \
        && decodes=("${step#service-}")
      [ "$step" = service-share ] && decodes=("gpu:$SHARE" cpu)
      limit=520 && [[ $step = service-lean || $step = service-share ]] && lean=(--lean) limit=570
      run "$step" "$limit" python3 bench/gpu.py --parts service --service-decode "${decodes[@]}" "${lean[@]}" \
        --workdir /tmp/bench-gpu --json "$out/$step.json"
      kill "${samplers[@]}" 2>/dev/null
      cp -r /tmp/bench-gpu/service-decode-*.log /tmp/bench-gpu/profile-* "$out/" 2>/dev/null ;;
    engine) run engine 300 python3 bench/gpu.py --parts engine --engine-sizes 1024 8192 \
      --json "$out/engine.json" ;;
    *) echo "unknown step $step (tests unit service-tests data service service-cpu service-gpu service-lean" \
         "service-share engine)"
      exit 2 ;;
  esac
done
# The device tool returns at most 8 files: the summary, the machine, each step's log and JSON as they are,
# and everything else (profiles, per-run logs, load samples) in archives, the traces (the largest) apart.
cd "$out" && shopt -s nullglob
for kind in service engine; do
  [ $kind = service ] && pattern='./profile-decode-*' || pattern='./profile-engine*'
  mapfile -t traces < <(find . -mindepth 2 -path "$pattern" -name 'trace_*.json.gz')
  [ ${#traces[@]} -gt 0 ] && tar czf "traces-$kind.tgz" "${traces[@]}" && rm -f "${traces[@]}"
done
extra=(*/ load-* service-decode-*.log install*.log)
[ ${#extra[@]} -gt 0 ] && tar czf extras.tgz "${extra[@]}" && rm -rf "${extra[@]}"
ls -l "$out"
