#!/usr/bin/env bash
# A pdserve cluster across network namespaces on one machine: each namespace is a "host" with
# its own interface and address, all joined by a bridge that lives in a namespace of its own,
# so the machine's own interfaces are never touched and traffic flows only between these hosts.
#
#   sudo scripts/netns-cluster.sh up [--name NAME] [--model DIR] [--routers R] [--prefill M]
#        [--decode N] [--redis]
#   sudo scripts/netns-cluster.sh exec client python -m pdserve.cli.main generate \
#        --addr 10.77.0.1:50051,10.77.0.2:50051 --prompt "Hello"
#   sudo scripts/netns-cluster.sh status | kill HOST | cut HOST | heal HOST | start HOST
#   sudo scripts/netns-cluster.sh down
#
# Layout (SUBNET = 10.77.0 by default; every host listens on its own address, so ports repeat):
#   router<i>  SUBNET.<1+i>   router: public gRPC :50051, HTTP :8000, internal :50061
#   kvstore    SUBNET.10      kvstore :50060
#   redis      SUBNET.11      redis-server :6379 (only with --redis)
#   prefill<i> SUBNET.<20+i>  worker --role prefill :50070
#   decode<i>  SUBNET.<40+i>  worker --role decode  :50070
#   client     SUBNET.100     nothing: run clients here (`exec client ...`)
# Every service has /metrics on :9090 of its host. Certificates (mutual TLS on the internal
# plane) name each host's address. Workers register with every router (each one's internal
# address) and advertise their host's address; the routers hand out the kvstore's. The routers
# sign resume tokens with one secret (DIR/resume.secret), so an SDK stream whose router host
# dies resumes on another. Router replicas need no shared store unless API keys carry limits
# or the flip controller is on (docs/ARCHITECTURE.md, "Router replicas"): --redis runs one on
# a host of its own and gives every router --redis-url.
#
# A host's services also get IPC and PID namespaces of their own (as in a container): UCX
# then sees separate nodes and moves KV over TCP between hosts, as it would between machines.
# With network namespaces alone UCX takes the hosts for one node and picks shared memory,
# which completes no transfer across network namespaces: every KV send times out. (A process in a network
# namespace alone can force TCP with UCX_TLS=tcp,self.)
#
# Commands:
#   check           exit 0 if namespaces, veth pairs and bridges can be made here (else the reason)
#   up              make the hosts and the network, certificates, start every service, wait
#                   until each worker registered; returns with the cluster running
#   down            stop every process on the hosts and remove the namespaces (DIR/logs stay)
#   status          hosts, addresses, processes
#   exec HOST CMD   run CMD on HOST (e.g. a client on `client`)
#   kill HOST       SIGKILL every process on HOST (the host dies)
#   cut HOST        take HOST's link down (partition); `heal HOST` brings it back
#   start HOST      start HOST's service again (after `kill`: the host reboots)
# Options (any command): --name NAME (default pdserve; [a-z0-9], at most 12 characters: the
# namespaces are NAME-<host>, NAME-net), --dir DIR (state: certificates, logs, pids; default
# ${TMPDIR:-/tmp}/pdserve-netns-NAME). `up` also takes: --subnet A.B.C, --model DIR (default:
# the built-in tiny model), --routers R (1), --prefill M (1), --decode N (2), --redis,
# --redis-server PATH (default: the one beside PY, else on PATH), --python PY (default:
# python3), --router-args/--worker-args/--kvstore-args "FLAGS" (extra flags),
# --kvstore-bytes N (64 MiB), --timeout S (180), --foreground (stay, and remove the layout
# on Ctrl-C, like `pdserve up`; without it `up` returns and `down` removes it).
set -euo pipefail

NAME=pdserve
DIR=""
SUBNET=10.77.0
MODEL=""
ROUTERS=1
REDIS=0
REDIS_SERVER=""
PREFILL=1
DECODE=2
PY=${PDSERVE_PYTHON:-python3}
ROUTER_ARGS=""
WORKER_ARGS=""
KVSTORE_ARGS=""
KVSTORE_BYTES=$((64 << 20))
TIMEOUT=180
FOREGROUND=0
ROUTER_PORT=50051
ROUTER_INTERNAL_PORT=50061
HTTP_PORT=8000
KVSTORE_PORT=50060
WORKER_PORT=50070
METRICS_PORT=9090
REDIS_PORT=6379

die() { echo "netns-cluster: $*" >&2; exit 1; }

args=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --name) NAME=$2; shift 2 ;;
        --dir) DIR=$2; shift 2 ;;
        --subnet) SUBNET=$2; shift 2 ;;
        --model) MODEL=$2; shift 2 ;;
        --routers) ROUTERS=$2; shift 2 ;;
        --redis) REDIS=1; shift ;;
        --redis-server) REDIS_SERVER=$2; shift 2 ;;
        --prefill) PREFILL=$2; shift 2 ;;
        --decode) DECODE=$2; shift 2 ;;
        --python) PY=$2; shift 2 ;;
        --router-args) ROUTER_ARGS=$2; shift 2 ;;
        --worker-args) WORKER_ARGS=$2; shift 2 ;;
        --kvstore-args) KVSTORE_ARGS=$2; shift 2 ;;
        --kvstore-bytes) KVSTORE_BYTES=$2; shift 2 ;;
        --timeout) TIMEOUT=$2; shift 2 ;;
        --foreground) FOREGROUND=1; shift ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        exec) args+=("$@"); break ;;  # the rest is HOST CMD...
        *) args+=("$1"); shift ;;
    esac
done
[[ ${#args[@]} -gt 0 ]] || die "a command is needed: check, up, down, status, exec, kill, cut, heal, start (--help)"
CMD=${args[0]}
[[ $NAME =~ ^[a-z0-9]{1,12}$ ]] || die "--name must be [a-z0-9], 1-12 characters: got '$NAME'"
[[ $SUBNET =~ ^[0-9]{1,3}\.[0-9]{1,3}\.[0-9]{1,3}$ ]] || die "--subnet wants A.B.C, got '$SUBNET'"
DIR=${DIR:-${TMPDIR:-/tmp}/pdserve-netns-$NAME}
NET="$NAME-net"  # the namespace holding the bridge

ns() { echo "$NAME-$1"; }

# host -> address (last octet by role and index)
addr_of() {
    local h=$1
    case "$h" in
        router[0-9]*) echo "$SUBNET.$((1 + ${h#router}))" ;;
        kvstore) echo "$SUBNET.10" ;;
        redis) echo "$SUBNET.11" ;;
        prefill[0-9]*) echo "$SUBNET.$((20 + ${h#prefill}))" ;;
        decode[0-9]*) echo "$SUBNET.$((40 + ${h#decode}))" ;;
        client) echo "$SUBNET.100" ;;
        *) die "unknown host '$h'" ;;
    esac
}

hosts_of_layout() {
    local i
    for ((i = 0; i < ROUTERS; i++)); do echo "router$i"; done
    echo kvstore
    ((REDIS == 0)) || echo redis
    for ((i = 0; i < PREFILL; i++)); do echo "prefill$i"; done
    for ((i = 0; i < DECODE; i++)); do echo "decode$i"; done
    echo client
}

known_hosts() {  # the hosts of a running layout
    [[ -f $DIR/hosts ]] || die "no layout '$NAME' here ($DIR/hosts missing): run up first"
    awk '{print $1}' "$DIR/hosts"
}

require_host() {
    known_hosts | grep -qx "$1" || die "no host '$1' in layout '$NAME' (hosts: $(known_hosts | tr '\n' ' '))"
}

# ------------------------------------------------------------------------------- network

net_check() {
    [[ $(id -u) -eq 0 ]] || { echo "needs root (ip netns, veth, bridge)"; return 1; }
    command -v ip >/dev/null || { echo "the ip command (iproute2) is missing"; return 1; }
    local probe="pdsprobe$$" out
    if ! out=$(ip netns add "$probe" 2>&1); then echo "ip netns add failed: $out"; return 1; fi
    if ! out=$(ip -n "$probe" link add br0 type bridge 2>&1 &&
               ip -n "$probe" link add p0 type veth peer name p1 2>&1 &&
               ip -n "$probe" link set p0 master br0 2>&1); then
        ip netns del "$probe" 2>/dev/null || true
        echo "bridge/veth in a namespace failed: $out"; return 1
    fi
    if ! out=$(ip netns exec "$probe" unshare --ipc --pid --fork --kill-child --mount-proc true 2>&1); then
        ip netns del "$probe" 2>/dev/null || true
        echo "unshare --ipc --pid (util-linux) failed: $out"; return 1
    fi
    ip netns del "$probe"
}

net_up() {
    local h a
    ip netns add "$NET"
    ip -n "$NET" link add br0 type bridge
    ip -n "$NET" link set br0 up
    for h in "$@"; do
        a=$(addr_of "$h")
        ip netns add "$(ns "$h")"
        # both ends are made in the bridge's namespace; the host end moves at once
        ip -n "$NET" link add "p-$h" type veth peer name eth0 netns "$(ns "$h")"
        ip -n "$NET" link set "p-$h" master br0
        ip -n "$NET" link set "p-$h" up
        ip -n "$(ns "$h")" link set lo up
        ip -n "$(ns "$h")" addr add "$a/24" dev eth0
        ip -n "$(ns "$h")" link set eth0 up
        echo "$h $(ns "$h") $a" >>"$DIR/hosts"
    done
}

kill_host() {
    local pids
    pids=$(ip netns pids "$(ns "$1")" 2>/dev/null || true)
    [[ -z $pids ]] || kill -KILL $pids 2>/dev/null || true
}

net_down() {
    local n h
    for n in $(ip netns list | awk '{print $1}' | grep "^$NAME-" || true); do
        h=${n#"$NAME-"}
        kill_host "$h"
        ip netns del "$n" 2>/dev/null || true
    done
}

# ------------------------------------------------------------------------------- services

router_internal_addrs() {  # every router's registry address, comma-separated
    local i out=()
    for ((i = 0; i < ROUTERS; i++)); do out+=("$(addr_of "router$i"):$ROUTER_INTERNAL_PORT"); done
    (IFS=,; echo "${out[*]}")
}

# ARGV := the command line of HOST's service (empty for the client).
service_argv() {
    local h=$1 a extra
    a=$(addr_of "$h")
    local tls=(--no-insecure --tls-dir "$DIR/certs" --tls-name "$h")
    ARGV=()
    case "$h" in
        router[0-9]*)
            read -r -a extra <<<"$ROUTER_ARGS"
            local shared=()
            ((REDIS == 0)) || shared=(--redis-url "redis://$(addr_of redis):$REDIS_PORT/0")
            ARGV=("$PY" -m pdserve.router --host "$a" --port $ROUTER_PORT
                --internal-port $ROUTER_INTERNAL_PORT --http-port $HTTP_PORT
                --metrics-port $METRICS_PORT --model "$MODEL"
                --kvstore-addr "$(addr_of kvstore):$KVSTORE_PORT"
                --resume-secret-file "$DIR/resume.secret" "${shared[@]}" "${tls[@]}"
                "${extra[@]}") ;;
        redis)
            ARGV=("$REDIS_SERVER" --bind "$a" --port $REDIS_PORT --save "" --appendonly no
                --protected-mode no --dir "$DIR/logs") ;;
        kvstore)
            read -r -a extra <<<"$KVSTORE_ARGS"
            ARGV=("$PY" -m pdserve.kvstore --host "$a" --port $KVSTORE_PORT
                --metrics-port $METRICS_PORT --capacity-bytes "$KVSTORE_BYTES" "${tls[@]}"
                "${extra[@]}") ;;
        prefill[0-9]* | decode[0-9]*)
            read -r -a extra <<<"$WORKER_ARGS"
            ARGV=("$PY" -m pdserve.worker --host "$a" --port $WORKER_PORT
                --metrics-port $METRICS_PORT --role "${h%%[0-9]*}" --model "$MODEL"
                --router-addr "$(router_internal_addrs)" "${tls[@]}"
                "${extra[@]}") ;;
    esac
}

start_host() {
    local h=$1
    service_argv "$h"
    [[ ${#ARGV[@]} -gt 0 ]] || return 0
    [[ -z $(ip netns pids "$(ns "$h")") ]] || die "$h is running (kill it first)"
    [[ ! -f $DIR/logs/$h.log ]] || mv "$DIR/logs/$h.log" "$DIR/logs/$h.$(date +%s%N).log"
    # the host's own network, IPC and PID namespaces (see the header); the environment
    # passes through (PDSERVE_* settings included)
    ip netns exec "$(ns "$h")" unshare --ipc --pid --fork --kill-child --mount-proc \
        env PDSERVE_LOG_FORMAT="${PDSERVE_LOG_FORMAT:-json}" "${ARGV[@]}" \
        >"$DIR/logs/$h.log" 2>&1 </dev/null &
    echo $! >"$DIR/pids/$h"
}

wait_ready() {  # every service printed its ready line
    local deadline=$((SECONDS + TIMEOUT)) h ready
    for h in "$@"; do
        service_argv "$h"
        [[ ${#ARGV[@]} -gt 0 ]] || continue
        ready='^PDSERVE_READY '
        [[ $h != redis ]] || ready='Ready to accept connections'
        until grep -q "$ready" "$DIR/logs/$h.log" 2>/dev/null; do
            if ! kill -0 "$(cat "$DIR/pids/$h")" 2>/dev/null; then
                tail -n 30 "$DIR/logs/$h.log" >&2 || true
                die "$h exited before it was ready (log: $DIR/logs/$h.log)"
            fi
            ((SECONDS < deadline)) || die "$h not ready in ${TIMEOUT}s (log: $DIR/logs/$h.log)"
            sleep 0.2
        done
    done
}

registered() {  # distinct instances router $1 logged as registered
    grep '"instance registered"' "$DIR/logs/$1.log" 2>/dev/null |
        grep -o '"instance": *"[^"]*"' | sort -u | wc -l
}

wait_registered() {  # every router knows `want` workers
    local want=$1 deadline=$((SECONDS + TIMEOUT)) i
    for ((i = 0; i < ROUTERS; i++)); do
        until (($(registered "router$i") >= want)); do
            ((SECONDS < deadline)) ||
                die "router$i: only $(registered "router$i") of $want workers registered in ${TIMEOUT}s"
            sleep 0.2
        done
    done
}

cmd_up() {
    local h hosts certs=()
    ((ROUTERS >= 1 && ROUTERS <= 9)) || die "--routers must be 1..9"
    ((PREFILL >= 1 && PREFILL <= 20 && DECODE >= 1 && DECODE <= 20)) ||
        die "--prefill and --decode must be 1..20"
    local why
    why=$(net_check) || die "cannot make namespaces here: $why"
    [[ -z $(ip netns list | awk '{print $1}' | grep "^$NAME-" || true) ]] ||
        die "layout '$NAME' exists (down it first, or pick another --name)"
    "$PY" -c "import pdserve" 2>/dev/null || die "$PY cannot import pdserve (--python PY)"
    if ((REDIS)); then
        REDIS_SERVER=${REDIS_SERVER:-$(dirname "$PY")/redis-server}
        [[ -x $REDIS_SERVER ]] || REDIS_SERVER=$(command -v redis-server) ||
            die "--redis: no redis-server beside $PY nor on PATH (--redis-server PATH)"
    fi
    if [[ -z $MODEL ]]; then
        MODEL=$("$PY" -c "from pdserve.model.tiny import ensure_builtin_tiny as t; print(t())")
    fi
    MODEL=$(cd "$MODEL" && pwd)
    rm -rf "$DIR"
    mkdir -p -m 700 "$DIR" "$DIR/logs" "$DIR/pids"
    declare -p MODEL PY ROUTER_ARGS WORKER_ARGS KVSTORE_ARGS KVSTORE_BYTES SUBNET \
        ROUTERS REDIS REDIS_SERVER PREFILL DECODE >"$DIR/config"
    # one resume secret for every router (a stream resumes on any of them)
    (umask 077; "$PY" -c "import secrets; print(secrets.token_hex(32))" >"$DIR/resume.secret")
    mapfile -t hosts < <(hosts_of_layout)
    trap 'echo "netns-cluster: up failed; removing layout $NAME" >&2; net_down' ERR EXIT
    net_up "${hosts[@]}"
    for h in "${hosts[@]}"; do
        case "$h" in
            router*) certs+=(--service "router:$h@$(addr_of "$h")") ;;
            kvstore) certs+=(--service "kvstore:kvstore@$(addr_of "$h")") ;;
            redis) ;;  # plaintext (a shared store on the internal network)
            prefill* | decode*) certs+=(--service "worker:$h@$(addr_of "$h")") ;;
        esac
    done
    "$PY" -m pdserve.cli.main certs make "$DIR/certs" "${certs[@]}" --service admin:admin \
        >"$DIR/logs/certs.log"
    # all at once: every address and port is known in advance, and a worker retries its
    # registration until the router answers
    for h in "${hosts[@]}"; do start_host "$h"; done
    wait_ready "${hosts[@]}"
    wait_registered $((PREFILL + DECODE))
    trap - ERR EXIT
    cmd_status
    local routers=()
    for ((i = 0; i < ROUTERS; i++)); do routers+=("$(addr_of "router$i"):$ROUTER_PORT"); done
    echo "PDSERVE_ROUTERS=$(IFS=,; echo "${routers[*]}")"
    echo "PDSERVE_NETNS_DIR=$DIR"
    echo "try: $0 --name $NAME exec client $PY -m pdserve.cli.main generate --addr $(IFS=,; echo "${routers[*]}") --prompt Hello"
    if ((FOREGROUND)); then
        echo "running; Ctrl-C stops every host and removes the layout"
        trap 'net_down; rm -rf "$DIR/certs" "$DIR/pids" "$DIR/hosts" "$DIR/config" "$DIR/resume.secret"' EXIT
        trap 'exit 0' INT TERM
        wait || true
    fi
}

cmd_status() {
    local h n a pids link
    printf '%-10s %-22s %-15s %-5s %s\n' HOST NAMESPACE ADDRESS LINK PIDS
    while read -r h n a; do
        pids=$(ip netns pids "$n" 2>/dev/null | tr '\n' ' ' || true)
        link=$(ip -n "$NET" -br link show "p-$h" 2>/dev/null | awk '{print $2}' || echo '?')
        printf '%-10s %-22s %-15s %-5s %s\n' "$h" "$n" "$a" "$link" "${pids:--}"
    done <"$DIR/hosts"
}

# ------------------------------------------------------------------------------- main
case "$CMD" in
    check) net_check ;;
    up) cmd_up ;;
    down) net_down; rm -rf "$DIR/certs" "$DIR/pids" "$DIR/hosts" "$DIR/config" "$DIR/resume.secret" ;;  # logs stay
    status) [[ -f $DIR/hosts ]] || die "no layout '$NAME' ($DIR/hosts missing)"; cmd_status ;;
    exec)
        [[ ${#args[@]} -ge 3 ]] || die "exec HOST CMD..."
        require_host "${args[1]}"
        exec ip netns exec "$(ns "${args[1]}")" "${args[@]:2}" ;;
    kill) [[ ${#args[@]} -eq 2 ]] || die "kill HOST"; require_host "${args[1]}"; kill_host "${args[1]}" ;;
    cut | heal)
        [[ ${#args[@]} -eq 2 ]] || die "$CMD HOST"
        require_host "${args[1]}"
        ip -n "$NET" link set "p-${args[1]}" "$([[ $CMD == cut ]] && echo down || echo up)" ;;
    start)
        [[ ${#args[@]} -eq 2 ]] || die "start HOST"
        require_host "${args[1]}"
        # shellcheck disable=SC1091
        source "$DIR/config"
        start_host "${args[1]}"
        wait_ready "${args[1]}" ;;
    *) die "unknown command '$CMD' (--help)" ;;
esac
