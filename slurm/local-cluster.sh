#!/usr/bin/env bash
# A real two-node SLURM cluster on this one machine, for tests of the sbatch scripts.
#
#   sudo slurm/local-cluster.sh start    # installs slurm-wlm + munge if missing, starts the daemons
#   export SLURM_CONF=/tmp/megamlm-slurm/slurm.conf
#   sbatch -N2 slurm/pretrain.sbatch configs/demo.yaml ...
#   sudo slurm/local-cluster.sh stop     # stops the daemons and removes the state
#
# slurmctld plus two slurmd daemons (Debian's slurm-wlm is built with multiple-slurmd support):
# nodes n1 and n2 with NodeAddr 127.0.0.1 and their own ports; n1/n2 resolve to 127.0.0.1 through
# /etc/hosts. munge provides authentication. Needs root (daemons, /etc/hosts, apt).
set -euo pipefail

ROOT_DIR=${MEGAMLM_SLURM_DIR:-/tmp/megamlm-slurm}
CONF="$ROOT_DIR/slurm.conf"
# each node announces every core of the machine (the two "nodes" share them); GNU nproc would
# answer OMP_NUM_THREADS instead (a test runner's per-worker thread count), hence env -u
CPUS_PER_NODE=${MEGAMLM_SLURM_CPUS:-$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)}

die() { echo "local-cluster: $*" >&2; exit 1; }

install_packages() {
    if command -v slurmctld >/dev/null && command -v munged >/dev/null; then
        return
    fi
    command -v apt-get >/dev/null || die "slurm-wlm and munge are missing and apt-get is not available"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null \
        || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null; } \
        || die "could not install slurm-wlm and munge"
}

write_config() {
    mkdir -p "$ROOT_DIR/state" "$ROOT_DIR/log" "$ROOT_DIR/spool-n1" "$ROOT_DIR/spool-n2"
    local memory
    memory=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 / 4 ))
    cat >"$CONF" <<EOF
ClusterName=megamlm-local
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=16817
SlurmdPort=16818
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# a requeued job waits cred_expire seconds before it may start again (default 120: two of the
# preemption tests' four minutes); also the job step credentials' lifetime: a step launches on
# loopback in well under a second
AuthInfo=cred_expire=10
CredType=cred/munge
StateSaveLocation=$ROOT_DIR/state
SlurmdSpoolDir=$ROOT_DIR/spool-%n
SlurmctldPidFile=$ROOT_DIR/slurmctld.pid
SlurmdPidFile=$ROOT_DIR/slurmd-%n.pid
SlurmctldLogFile=$ROOT_DIR/log/slurmctld.log
SlurmdLogFile=$ROOT_DIR/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
# a requeued job that has waited out cred_expire starts at the main scheduler's next pass, which runs
# every sched_interval seconds (default 60: up to a minute more of each preemption test)
SchedulerParameters=sched_interval=2
ReturnToService=2
JobRequeue=1
KillWait=60
InactiveLimit=0
MinJobAge=600
SlurmdTimeout=60
NodeName=n1 NodeAddr=127.0.0.1 NodeHostname=n1 Port=17001 CPUs=$CPUS_PER_NODE RealMemory=$memory State=UNKNOWN
NodeName=n2 NodeAddr=127.0.0.1 NodeHostname=n2 Port=17002 CPUs=$CPUS_PER_NODE RealMemory=$memory State=UNKNOWN
PartitionName=local Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF
}

start_munge() {
    if pgrep -x munged >/dev/null; then
        return
    fi
    mkdir -p /etc/munge /run/munge /var/lib/munge /var/log/munge
    if [ ! -s /etc/munge/munge.key ]; then
        dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
    fi
    chown -R munge:munge /etc/munge /run/munge /var/lib/munge /var/log/munge 2>/dev/null || true
    chmod 0400 /etc/munge/munge.key
    if id munge >/dev/null 2>&1; then
        runuser -u munge -- munged
    else
        munged --force
    fi
}

add_hosts() {
    for node in n1 n2; do
        grep -qE "^127\.0\.0\.1[[:space:]].*\b$node\b" /etc/hosts || echo "127.0.0.1 $node" >>/etc/hosts
    done
}

start() {
    [ "$(id -u)" -eq 0 ] || die "needs root (daemons, /etc/hosts, packages)"
    # live daemons only: a container's init may leave zombies of an earlier cluster behind
    if ps -eo stat=,comm= | awk '$1 !~ /^Z/ && ($2 == "slurmctld" || $2 == "slurmd") {found = 1}
                                 END {exit !found}'; then
        die "SLURM daemons already run on this machine (ports 16817/17001/17002); stop them first"
    fi
    install_packages
    write_config
    add_hosts
    start_munge
    export SLURM_CONF="$CONF"
    slurmctld -c -f "$CONF"
    slurmd -N n1 -f "$CONF"
    slurmd -N n2 -f "$CONF"
    for _ in $(seq 60); do
        if [ "$(sinfo -h -N -t idle -o '%N' 2>/dev/null | sort -u | wc -l)" -eq 2 ]; then
            echo "local-cluster: nodes n1 n2 idle; export SLURM_CONF=$CONF"
            return
        fi
        scontrol update nodename=n1,n2 state=resume >/dev/null 2>&1 || true
        sleep 1
    done
    sinfo -N >&2 || true
    tail -n 20 "$ROOT_DIR"/log/*.log >&2 || true
    die "the nodes did not become idle"
}

stop() {
    # a job still running at the stop: its batch script (in the spool) and that script's sruns outlive
    # the daemons (seen after the test suite: a requeued job's script and two sruns, 20 minutes on)
    for pid in $(pgrep -f "$ROOT_DIR/spool" || true); do
        pkill -KILL -P "$pid" 2>/dev/null || true
        kill -KILL "$pid" 2>/dev/null || true
    done
    for pidfile in "$ROOT_DIR"/slurmd-*.pid "$ROOT_DIR"/slurmctld.pid; do
        if [ -f "$pidfile" ]; then
            kill "$(cat "$pidfile")" 2>/dev/null || true
        fi
    done
    sleep 1
    pkill -f "slurmd -N n[12] -f $CONF" 2>/dev/null || true
    pkill -f "slurmctld -c -f $CONF" 2>/dev/null || true
    # job step daemons outlive slurmd; this machine's only ones are ours
    pkill -f "^slurmstepd" 2>/dev/null || true
    sleep 1
    pkill -KILL -f "^slurmstepd" 2>/dev/null || true
    for _ in $(seq 10); do
        ps -eo stat=,comm= | awk '$1 !~ /^Z/ && $2 ~ /^slurm(ctld|d|stepd)$/ {found = 1} END {exit !found}' \
            || break
        sleep 1
    done
    rm -rf "$ROOT_DIR"
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    *) die "usage: $0 start|stop" ;;
esac
