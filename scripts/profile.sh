#!/usr/bin/env bash
# Where the work goes during one steady run: starts `delay-bridge-bench steady` (arguments
# after the broker go to it) and, once the bridge consumes, samples for PROFILE_SECONDS (10):
#   - the broker's Erlang processes, their reductions summed by kind: channel processes, each
#     queue (the sandbox's random suffix removed), readers, writers, the rest by name;
#   - the broker's system calls and context switches, and the bridge's (perf stat);
#   - the bridge's context switches per thread, and the broker's per kind of thread (its
#     schedulers, dirty I/O and dirty CPU schedulers, poller, aux: /proc).
# `baseline` samples the broker during the bench's plain transit instead (one durable queue,
# the same publisher and consumer, paced at --rate), with no bridge: the same figures for one
# transit per message. Figures are totals over the window: divide by rate x seconds.
#   bash scripts/profile.sh                      # RabbitMQ 3.x on 5672, steady 2000 msg/s
#   bash scripts/profile.sh 3 baseline           # the plain transit at 2000 msg/s
#   bash scripts/profile.sh 4 --rate 1000        # RabbitMQ 4.x on 5673, other steady options
# With PROFILE_RECORD=1 the bridge is also sampled (`perf record -F 999`, no call graphs) over
# the same window, and its samples are printed by where they fall: the kernel, libc, and in
# the binary by the crate of the function (lapin and amq_protocol, tokio, delay_bridge, std
# and the rest by name); the data stays in target/profile-bridge.data for `perf report`.
# PROFILE_RECORD=callgraph records call graphs too (`--call-graph dwarf`, 299 Hz), to see
# who calls the allocator: `perf report -i target/profile-bridge.data --no-children -S
# malloc -G`.
# With PROFILE_ALLOCS=1 the bridge's calls to glibc's malloc, realloc and free are counted
# over the window instead (uprobes: `perf probe -x <libc> malloc`; each call traps, so the
# bridge runs several times slower meanwhile and the run's lateness means nothing); divide
# by rate x seconds for calls per message. PROFILE_ALLOCS=callgraph also records who calls
# malloc (every 10th call, DWARF unwinding) into target/profile-allocs.data, and prints
# the nearest function of the project or its AMQP client above each allocation.
# With PROFILE_EPROF=<part of a queue name> (for example `.work`, or `baseline`), the queue
# process whose name contains it is then traced for PROFILE_EPROF_SECONDS (5) with Erlang's
# eprof, and its busiest functions are printed by calls, with their calls per delivery the
# queue made meanwhile (tracing slows the broker: the run's lateness no longer means much).
# Needs perf (Debian's linux-perf) and root when the broker runs as another user; the broker on
# this machine. Reductions are the Erlang VM's unit of work, not CPU time: they show which
# processes work, not how much CPU each costs.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -f "$HOME/.cargo/env" ] && . "$HOME/.cargo/env"
broker=3
case "${1:-}" in 3|4) broker=$1; shift ;; esac
baseline=false
[ "${1:-}" = baseline ] && { baseline=true; shift; }
seconds=${PROFILE_SECONDS:-10}
case $broker in
  3) bash scripts/broker.sh >&2; url="amqp://guest:guest@127.0.0.1:5672/%2f"; ctl=(rabbitmqctl) ;;
  4) bash scripts/debian-broker.sh trixie start >&2; url="amqp://guest:guest@127.0.0.1:5673/%2f"; ctl=(bash scripts/debian-broker.sh trixie ctl) ;;
esac
command -v perf >/dev/null || { echo "profile.sh: perf is missing (apt-get install linux-perf)" >&2; exit 1; }
cargo build --release --quiet --workspace

broker_pid=$("${ctl[@]}" eval 'list_to_integer(os:getpid()).' | tr -dc 0-9)
log=$(mktemp)
if $baseline; then
  args=(--seconds 1 --baseline-count 20000 --baseline-paced-seconds $((seconds + 15)))
else
  args=(--seconds $((seconds + 20)))
fi
DELAY_BRIDGE_URL=$url target/release/delay-bridge-bench steady "${args[@]}" "$@" >"$log" 2>&1 &
bench=$!
trap 'kill $bench 2>/dev/null || true; rm -f "$log"' EXIT
bridge=""
for _ in $(seq 1 600); do
  if $baseline; then
    # The paced pass follows a flat-out pass of 20 000, which takes a second or two.
    queues=$("${ctl[@]}" -q list_queues name 2>/dev/null || true)
    [[ $queues == *delay-bridge-bench-baseline* ]] && break
  else
    bridge=$(pgrep -x -P "$bench" delay-bridge || true)
    [ -n "$bridge" ] && break
  fi
  kill -0 "$bench" 2>/dev/null || { cat "$log" >&2; echo "profile.sh: the bench ended before the load started" >&2; exit 1; }
  sleep 0.5
done
$baseline || [ -n "$bridge" ] || { echo "profile.sh: no bridge process within 300 s" >&2; exit 1; }
sleep 5 # past the start, into the steady load

if $baseline; then
  echo "== broker (pid $broker_pid) during the plain transit, $seconds s"
else
  echo "== broker (pid $broker_pid) and bridge (pid $bridge), $seconds s of steady load"
fi
threads() {
  [ -n "$bridge" ] || return 0
  for t in /proc/"$bridge"/task/*; do
    printf '%s %s %s %s\n' "${t##*/}" "$(cat "$t/comm")" \
      "$(awk '/^voluntary_ctxt/ {print $2}' "$t/status")" "$(awk '/^nonvoluntary_ctxt/ {print $2}' "$t/status")"
  done | sort
}
broker_threads() {
  # Summed by kind: the VM names its threads `<n>_scheduler`, `<n>_dirty_io_sch...`, etc.
  for t in /proc/"$broker_pid"/task/*; do
    printf '%s %s %s\n' "$(sed -e 's/^[0-9]*_//' -e 's/_sch.*$//' -e 's/[0-9]*$//' "$t/comm")" \
      "$(awk '/^voluntary_ctxt/ {print $2}' "$t/status")" "$(awk '/^nonvoluntary_ctxt/ {print $2}' "$t/status")"
  done | awk 'NF == 3 {v[$1] += $2; n[$1] += $3} END {for (k in v) print k, v[k], n[k]}' | sort
}
before=$(threads)
broker_before=$(broker_threads)
events=syscalls:sys_enter_read,syscalls:sys_enter_write,syscalls:sys_enter_writev,syscalls:sys_enter_recvfrom,syscalls:sys_enter_pwrite64,syscalls:sys_enter_fsync,syscalls:sys_enter_fdatasync,syscalls:sys_enter_futex,syscalls:sys_enter_epoll_wait,context-switches,task-clock
perf stat -e "$events" -p "$broker_pid" -o /dev/stdout -- sleep "$seconds" | sed 's/^/broker: /' &
perf_broker=$!
perf_bridge=""
if [ -n "$bridge" ] && [ -n "${PROFILE_ALLOCS:-}" ]; then
  libc=$(ldd "/proc/$bridge/exe" | awk '/libc\.so/ {print $3}')
  for f in malloc realloc free; do
    perf probe -q -x "$libc" "$f" 2>/dev/null || true # already there from an earlier run
  done
  perf stat -e probe_libc:malloc,probe_libc:realloc,probe_libc:free -p "$bridge" -o /dev/stdout -- sleep "$seconds" | sed 's/^/bridge allocations: /' &
  perf_bridge=$!
  if [ "$PROFILE_ALLOCS" = callgraph ]; then
    perf record -q -e probe_libc:malloc -c 10 --call-graph dwarf,32768 -p "$bridge" -o target/profile-allocs.data -- sleep "$seconds" 2>/dev/null &
    perf_bridge="$perf_bridge $!"
  fi
elif [ -n "$bridge" ]; then
  perf stat -e "$events" -p "$bridge" -o /dev/stdout -- sleep "$seconds" | sed 's/^/bridge: /' &
  perf_bridge=$!
  if [ "${PROFILE_RECORD:-}" = callgraph ]; then
    # Call graphs from the stack (DWARF unwinding: a release build has no frame pointers),
    # at a lower rate: each sample copies 8 KiB of stack.
    perf record -q -F 299 --call-graph dwarf -p "$bridge" -o target/profile-bridge.data -- sleep "$seconds" 2>/dev/null &
    perf_bridge="$perf_bridge $!"
  elif [ "${PROFILE_RECORD:-}" = 1 ]; then
    perf record -q -F 999 -p "$bridge" -o target/profile-bridge.data -- sleep "$seconds" 2>/dev/null &
    perf_bridge="$perf_bridge $!"
  fi
fi
"${ctl[@]}" eval "
Snap = fun() -> maps:from_list([{P, R} || P <- erlang:processes(), {reductions, R} <- [erlang:process_info(P, reductions)]]) end,
Kind = fun(P) ->
  case erlang:process_info(P, [registered_name, dictionary]) of
    undefined -> gone;
    [{registered_name, N}, _] when N =/= [] -> N;
    [_, {dictionary, D}] ->
      case proplists:get_value(process_name, D) of
        {rabbit_amqqueue_process, {resource, _, queue, Q}} ->
          {queue, re:replace(Q, \"-[0-9a-f]{8}(-[0-9a-f]{8})?\", \"\", [global, {return, binary}])};
        {K, _} -> K;
        undefined -> proplists:get_value('\$initial_call', D, unknown)
      end
  end end,
A = Snap(), timer:sleep($seconds * 1000), B = Snap(),
Sum = lists:foldl(fun({P, R}, M) -> K = Kind(P), maps:update_with(K, fun(X) -> X + R - maps:get(P, A, 0) end, R - maps:get(P, A, 0), M) end, #{}, maps:to_list(B)),
Total = lists:sum(maps:values(Sum)),
io:format(\"reductions in ~b s: ~b~n\", [$seconds, Total]),
[io:format(\"~6.2f%  ~p~n\", [100 * V / Total, K]) || {K, V} <- lists:sublist(lists:reverse(lists:keysort(2, maps:to_list(Sum))), 12)],
ok." | sed 's/^/broker processes: /'
wait "$perf_broker" $perf_bridge || true
if [ -n "${PROFILE_EPROF:-}" ]; then
  # The broker writes the log; RabbitMQ 4.x runs in scripts/debian-broker.sh trixie's chroot.
  eprof_log=/tmp/profile-eprof.$$
  local_log=$eprof_log
  [ "$broker" = 4 ] && local_log=${RMQ4_ROOT:-/var/lib/delay-bridge/rabbitmq-4-trixie}$eprof_log
  "${ctl[@]}" eval "
Queue = fun(P) -> case erlang:process_info(P, dictionary) of
  {dictionary, D} -> case proplists:get_value(process_name, D) of
    {rabbit_amqqueue_process, {resource, _, queue, Q}} -> binary:match(Q, <<\"$PROFILE_EPROF\">>) =/= nomatch;
    _ -> false end;
  _ -> false end end,
case [P || P <- erlang:processes(), Queue(P)] of
  [] -> io:format(\"no queue process matches ~s~n\", [\"$PROFILE_EPROF\"]);
  Ps -> eprof:start(), eprof:start_profiling(Ps), timer:sleep(${PROFILE_EPROF_SECONDS:-5} * 1000),
        eprof:stop_profiling(), eprof:log(\"$eprof_log\"), eprof:analyze(total, [{sort, calls}]), eprof:stop(),
        io:format(\"traced ~b queue process(es)~n\", [length(Ps)])
end." >/dev/null
  if [ -f "$local_log" ]; then
    echo "queue $PROFILE_EPROF, eprof over ${PROFILE_EPROF_SECONDS:-5} s: the busiest functions by calls, and calls per delivery"
    deliveries=$(awk '$1 == "rabbit_queue_consumers:deliver_to_consumer/3" {print $2}' "$local_log")
    awk '$1 != "Total:" && $2 ~ /^[0-9]+$/ {print $1, $2}' "$local_log" | sort -k2,2nr | head -15 |
      awk -v d="${deliveries:-0}" '{printf "  %-70s %10d %8.1f\n", $1, $2, d ? $2 / d : 0}'
    echo "  deliveries (rabbit_queue_consumers:deliver_to_consumer/3): ${deliveries:-0}"
    rm -f "$local_log"
  fi
fi
if [ -n "${PROFILE_RECORD:-}" ] && [ -f target/profile-bridge.data ]; then
  echo "bridge samples by where they fall (perf record -F 999 over the window; share of all samples):"
  # Each line: percent, shared object, symbol. A Rust symbol's crate is its first path
  # segment (inside the leading `<` of a trait method's `<Type as Trait>::method`).
  perf report -i target/profile-bridge.data --no-children --sort dso,sym --stdio -g none 2>/dev/null |
    awk '$1 ~ /%$/ {
      pct = $1; sub(/%$/, "", pct); dso = $2; sym = ""
      for (i = 4; i <= NF; i++) sym = sym (i > 4 ? " " : "") $i
      if (dso ~ /kernel/) where = "kernel"
      else if (dso ~ /^libc/) where = "libc (allocation, memcpy, locks)"
      else if (dso !~ /delay-bridge/) where = dso
      else {
        s = sym; sub(/^<+/, "", s); sub(/^&(mut )?/, "", s); split(s, part, "::"); where = part[1]
        if (where ~ /^(lapin|amq_protocol)/) where = "lapin, amq_protocol (AMQP client and codec)"
        else if (where ~ /^(core|alloc|std)$/) where = "std (core, alloc, std)"
      }
      total[where] += pct
    }
    END { for (w in total) printf "  %6.2f%%  %s\n", total[w], w }' | sort -k1,1nr | head -15
fi
if [ "${PROFILE_ALLOCS:-}" = callgraph ] && [ -f target/profile-allocs.data ]; then
  echo "who calls malloc (every 10th call; the nearest function of the project or its AMQP client, share of samples):"
  perf script -i target/profile-allocs.data -F sym 2>/dev/null | awk '
    /^$/ { if (seen) { n++; who[first]++ }; seen = 0; first = ""; next }
    { sub(/^[ \t]+/, ""); sub(/::h[0-9a-f]{16}$/, "") }
    !seen && /(delay_bridge|amq_protocol|lapin)::/ && !/^(<)?(alloc|core|std)::/ { first = $0; seen = 1 }
    END { if (seen) { n++; who[first]++ }; for (w in who) printf "  %5.1f%%  %s\n", 100 * who[w] / n, substr(w, 1, 140) }' |
    sort -k1,1nr | head -20
fi
after=$(threads)
broker_after=$(broker_threads)
echo "broker threads by kind: voluntary and involuntary context switches in the window"
join <(echo "$broker_before") <(echo "$broker_after") | awk '$4 - $2 + $5 - $3 > 0 {printf "  %-18s %8d %8d\n", $1, $4 - $2, $5 - $3}' | sort -k2,2nr
[ -n "$bridge" ] && echo "bridge threads: id, name, voluntary and involuntary context switches in the window"
join <(echo "$before") <(echo "$after") | awk '{printf "  %-8s %-18s %8d %8d\n", $1, $2, $6 - $3, $7 - $4}'
wait "$bench" || true
echo "== the run's report"
cat "$log"
