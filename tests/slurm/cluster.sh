#!/usr/bin/env bash
# Bring up / tear down a real single-node SLURM cluster on loopback for tests.
#
#   tests/slurm/cluster.sh up     [STATE_DIR]   install (if needed), configure, start, wait until usable
#   tests/slurm/cluster.sh down   [STATE_DIR]   stop every daemon by its recorded pid
#   tests/slurm/cluster.sh status               exit 0 if the cluster answers
#
# Daemons: munged, mariadbd + slurmdbd (accounting, so `sacct` works: the
# snakemake SLURM executor plugin polls job status with sacct), slurmctld,
# slurmd. Node "localhost" has $(nproc) CPUs and 8 fake GPUs; partition and
# account are both "eagleflow-test". Pidfiles, logs, spool and the database
# live under STATE_DIR (default /tmp/eagleflow-slurm); the config goes to
# /etc/slurm (the jobstep plugin strips SLURM_CONF, so it must be the default
# location). Needs root and Debian/Ubuntu (apt). See
# shared/notes/slurm-local.md for background.
set -euo pipefail

ACTION=${1:-}
STATE_DIR=${2:-/tmp/eagleflow-slurm}
PARTITION=eagleflow-test
ACCOUNT=eagleflow-test
CLUSTER=eagleflow
DB_PORT=${EAGLEFLOW_SLURM_DB_PORT:-3306}
DB_PASS=eagleflow-test # loopback-only test database
PACKAGES=(slurmctld slurmd slurm-client munge slurmdbd mariadb-server)
CONF_DIR=/etc/slurm
MUNGE_RUN=/run/munge # munged's default socket dir; slurm's auth/munge looks there

log() { echo "[cluster.sh] $*"; }
die() { echo "[cluster.sh] ERROR: $*" >&2; exit 1; }

usage() {
    echo "usage: $0 up [STATE_DIR] | down [STATE_DIR] | status" >&2
    exit 2
}

# ---- paths under STATE_DIR --------------------------------------------------
set_paths() {
    # Absolute path: it is written into configs read by daemons with cwd=/.
    mkdir -p "$STATE_DIR"
    STATE_DIR=$(cd "$STATE_DIR" && pwd -P)
    RUN=$STATE_DIR/run
    LOGS=$STATE_DIR/log
    SPOOL=$STATE_DIR/spool
    DEVDIR=$STATE_DIR/dev
    DBDIR=$STATE_DIR/mysql
    MUNGE_STATE=$STATE_DIR/munge # owned by user munge, which munged runs as (it writes pid/log there)
    DB_SOCK=$RUN/mysqld.sock
}

# ---- pid helpers ------------------------------------------------------------
# Name a daemon's process has (/proc/PID/comm); Debian starts slurmctld/slurmd
# through alternatives symlinks, so "-wlm" suffixes are accepted too.
pid_is() { # pid_is PID NAME -> 0 if PID is alive and is NAME
    local pid=$1 name=$2 comm
    [[ $pid =~ ^[0-9]+$ ]] || return 1
    comm=$(cat "/proc/$pid/comm" 2>/dev/null) || return 1
    [[ $comm == "$name" || $comm == "$name-wlm" ]]
}

pidfile_of() {
    case $1 in
    munged) echo "$MUNGE_STATE/munged.pid" ;;
    mariadbd) echo "$RUN/mariadbd.pid" ;;
    *) echo "$RUN/$1.pid" ;;
    esac
}

running() { # running NAME -> 0 if the pid in NAME's pidfile is that daemon
    local f
    f=$(pidfile_of "$1")
    [[ -s $f ]] && pid_is "$(head -n1 "$f")" "$1"
}

wait_for() { # wait_for SECONDS DESCRIPTION CMD... -> poll CMD every 0.5 s
    local secs=$1 what=$2 i
    shift 2
    for ((i = 0; i < secs * 2; i++)); do
        if "$@" >/dev/null 2>&1; then return 0; fi
        sleep 0.5
    done
    echo "[cluster.sh] timed out after ${secs}s waiting for $what" >&2
    return 1
}

dump_logs() {
    local f
    for f in "$LOGS"/*.log "$MUNGE_STATE"/munged.log; do
        [[ -f $f ]] || continue
        echo "===== $f (last 40 lines) =====" >&2
        tail -n 40 "$f" >&2 || true
    done
}

fail() { dump_logs; die "$*"; }

# ---- install ----------------------------------------------------------------
missing_packages() {
    local p
    for p in "${PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}\n' "$p" 2>/dev/null | grep -q '^install ok installed$' || echo "$p"
    done
}

install_packages() {
    local missing
    missing=$(missing_packages)
    [[ -z $missing ]] && return 0
    local apt_log=$LOGS/apt.log
    mkdir -p "$LOGS"
    log "installing: ${missing//$'\n'/ } (output in $apt_log)"
    export DEBIAN_FRONTEND=noninteractive
    # shellcheck disable=SC2086
    if ! apt-get install -y --no-install-recommends $missing >"$apt_log" 2>&1; then
        # Usually "Unable to locate package": no package lists yet.
        log "install failed; running apt-get update and retrying"
        if ! { apt-get update && apt-get install -y --no-install-recommends $missing; } >>"$apt_log" 2>&1; then
            tail -n 30 "$apt_log" >&2
            die "apt-get install failed"
        fi
    fi
}

# ---- configuration ----------------------------------------------------------
write_if_changed() { # write_if_changed FILE MODE < content
    local f=$1 mode=$2 tmp
    tmp=$(mktemp)
    cat >"$tmp"
    if [[ -f $f ]] && cmp -s "$tmp" "$f"; then
        rm -f "$tmp"
    else
        install -m "$mode" -o root -g root "$tmp" "$f"
        rm -f "$tmp"
        log "wrote $f"
        CONFIG_CHANGED=1
    fi
}

write_config() {
    local cpus mem_mb i
    cpus=$(nproc)
    # 85% of RAM: slurmd drains a node that reports less memory than configured.
    mem_mb=$(awk '/^MemTotal:/ { printf "%d", $2 / 1024 * 0.85 }' /proc/meminfo)

    mkdir -p "$CONF_DIR" "$RUN" "$LOGS" "$SPOOL/ctld" "$SPOOL/d" "$DEVDIR"
    # Fake GPUs: gres File= must be a character device, else the GPU is
    # dropped and the node drains; /dev/null is one.
    for i in 0 1 2 3 4 5 6 7; do
        ln -sfn /dev/null "$DEVDIR/nvidia$i"
    done

    write_if_changed "$CONF_DIR/slurm.conf" 644 <<EOF
# Written by tests/slurm/cluster.sh (state in $STATE_DIR). Test cluster only.
ClusterName=$CLUSTER
SlurmctldHost=localhost
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
SwitchType=switch/none
# No cgroups needed (none usable here).
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
# Without a default each job would claim all of the node's memory.
DefMemPerCPU=1000
GresTypes=gpu
# Keep finished jobs visible to squeue for 10 min.
MinJobAge=600
# A node that restarts (e.g. after down/up) comes back instead of staying DOWN.
ReturnToService=2
StateSaveLocation=$SPOOL/ctld
SlurmdSpoolDir=$SPOOL/d
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd.pid
SlurmctldLogFile=$LOGS/slurmctld.log
SlurmdLogFile=$LOGS/slurmd.log
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
# Record GPU allocations, so sacct's AllocTRES shows gres/gpu.
AccountingStorageTRES=gres/gpu
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
# No mail here; the default /bin/mail is absent and slurmctld logs an error.
MailProg=/bin/true
NodeName=localhost NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem_mb Gres=gpu:8 State=UNKNOWN
PartitionName=$PARTITION Nodes=localhost Default=YES MaxTime=INFINITE State=UP
EOF

    write_if_changed "$CONF_DIR/gres.conf" 644 <<EOF
# Written by tests/slurm/cluster.sh: 8 fake GPUs (symlinks to /dev/null).
AutoDetect=off
NodeName=localhost Name=gpu File=$DEVDIR/nvidia[0-7]
EOF

    # slurmdbd refuses a slurmdbd.conf readable by others (it holds a password).
    write_if_changed "$CONF_DIR/slurmdbd.conf" 600 <<EOF
# Written by tests/slurm/cluster.sh. Test cluster only.
AuthType=auth/munge
DbdHost=localhost
SlurmUser=root
PidFile=$RUN/slurmdbd.pid
LogFile=$LOGS/slurmdbd.log
StorageType=accounting_storage/mysql
# TCP on loopback: mariadbd's unix socket is in STATE_DIR, not where the client library looks.
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=$DB_PASS
StorageLoc=slurm_acct_db
EOF

    if [[ ! -s /etc/munge/munge.key ]]; then
        log "creating munge key"
        mkdir -p /etc/munge
        chown munge:munge /etc/munge
        chmod 700 /etc/munge
        mungekey --create --keyfile=/etc/munge/munge.key
        chown munge:munge /etc/munge/munge.key
        chmod 400 /etc/munge/munge.key
    fi
}

# ---- daemons ----------------------------------------------------------------
start_munged() {
    if running munged; then log "munged already running"; return 0; fi
    log "starting munged"
    # munged must run as user munge; its socket dir and state dir must be its own.
    mkdir -p "$MUNGE_RUN" "$MUNGE_STATE"
    chown munge:munge "$MUNGE_RUN" "$MUNGE_STATE"
    chmod 755 "$MUNGE_RUN"
    chmod 700 "$MUNGE_STATE"
    runuser -u munge -- munged --pid-file="$MUNGE_STATE/munged.pid" \
        --log-file="$MUNGE_STATE/munged.log" || fail "munged failed to start"
    wait_for 15 munged bash -c 'munge -n | unmunge' || fail "munge does not work"
}

db() { mariadb --socket="$DB_SOCK" -u root "$@"; }

start_mariadb() {
    if running mariadbd; then log "mariadbd already running"; return 0; fi
    if [[ ! -d $DBDIR/mysql ]]; then
        log "initialising database in $DBDIR"
        mkdir -p "$DBDIR"
        # root@localhost gets unix_socket auth: OS user root logs in without a password.
        mariadb-install-db --no-defaults --user=root --datadir="$DBDIR" \
            --auth-root-authentication-method=socket >"$LOGS/mariadb-install.log" 2>&1 ||
            fail "mariadb-install-db failed (see $LOGS/mariadb-install.log)"
    fi
    log "starting mariadbd (127.0.0.1:$DB_PORT)"
    rm -f "$DB_SOCK"
    # --no-defaults: ignore /etc/mysql (Debian's socket/pid paths under /run/mysqld).
    # mariadbd does not daemonize: detach it with setsid; it writes its own pidfile.
    # slurmdbd logs an error below a 128M buffer pool / 900 s lock wait.
    setsid mariadbd --no-defaults --user=root --datadir="$DBDIR" \
        --socket="$DB_SOCK" --pid-file="$RUN/mariadbd.pid" \
        --port="$DB_PORT" --bind-address=127.0.0.1 --skip-name-resolve \
        --log-error="$LOGS/mariadb.log" \
        --innodb-buffer-pool-size=128M --innodb-lock-wait-timeout=900 \
        </dev/null >/dev/null 2>&1 &
    local bg=$! i
    for ((i = 0; i < 120; i++)); do # 60 s; stop early if it died (e.g. port in use)
        mariadb-admin --socket="$DB_SOCK" -u root ping >/dev/null 2>&1 && break
        kill -0 "$bg" 2>/dev/null || fail "mariadbd exited (port $DB_PORT in use? set EAGLEFLOW_SLURM_DB_PORT)"
        sleep 0.5
    done
    ((i < 120)) || fail "mariadbd did not come up in 60 s"
    wait_for 10 "mariadbd pidfile" running mariadbd || fail "mariadbd pidfile missing"
    # slurmdbd connects over TCP as 127.0.0.1 (skip-name-resolve: no 'localhost' mapping).
    db -e "CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '$DB_PASS';
           CREATE DATABASE IF NOT EXISTS slurm_acct_db;
           GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';" || fail "database setup failed"
}

start_slurmdbd() {
    if running slurmdbd; then log "slurmdbd already running"; return 0; fi
    log "starting slurmdbd"
    slurmdbd || fail "slurmdbd failed to start" # daemonizes, writes PidFile
    wait_for 60 slurmdbd sacctmgr -n list cluster || fail "slurmdbd does not answer"
}

setup_accounts() {
    # sacctmgr -i add ... fails when the entity exists, so check first.
    if [[ -z $(sacctmgr -nP list cluster "$CLUSTER" format=cluster) ]]; then
        log "sacctmgr: adding cluster $CLUSTER"
        sacctmgr -i add cluster "$CLUSTER" >/dev/null
    fi
    if [[ -z $(sacctmgr -nP list account "$ACCOUNT" format=account) ]]; then
        log "sacctmgr: adding account $ACCOUNT"
        sacctmgr -i add account "$ACCOUNT" Cluster="$CLUSTER" Description=eagleflow-tests Organization=eagleflow >/dev/null
    fi
    # Query the association: "list user account=..." does not filter by account.
    if [[ -z $(sacctmgr -nP list assoc cluster="$CLUSTER" account="$ACCOUNT" user=root format=user) ]]; then
        log "sacctmgr: adding user root to $ACCOUNT"
        sacctmgr -i add user root Account="$ACCOUNT" Cluster="$CLUSTER" >/dev/null
    fi
}

start_slurmctld() {
    if running slurmctld; then log "slurmctld already running"; return 0; fi
    log "starting slurmctld"
    slurmctld || fail "slurmctld failed to start" # daemonizes, writes pidfile
}

start_slurmd() {
    if running slurmd; then log "slurmd already running"; return 0; fi
    log "starting slurmd"
    # -N: the machine's hostname is not "localhost", the configured node name.
    slurmd -N localhost || fail "slurmd failed to start"
}

node_state() { sinfo -h -n localhost -o %T 2>/dev/null | head -n1; }

state_usable() { # state_usable STATE
    case $1 in
    idle | mixed | allocated | completing) return 0 ;; # "up" includes a busy node
    *) return 1 ;;
    esac
}

wait_idle() {
    local i st=""
    for ((i = 0; i < 120; i++)); do # 60 s
        st=$(node_state || true)
        if state_usable "$st"; then
            log "node localhost is $st"
            return 0
        fi
        # A node left DOWN/DRAINED from a previous run: bring it back.
        if [[ $st == down* || $st == drain* ]] && ((i % 10 == 5)); then
            scontrol update NodeName=localhost State=RESUME >/dev/null 2>&1 || true
        fi
        sleep 0.5
    done
    sinfo -N -l >&2 || true
    fail "node not idle after 60 s (state: ${st:-no answer})"
}

cmd_up() {
    [[ $(id -u) == 0 ]] || die "must run as root"
    set_paths
    # Refuse to reconfigure a cluster that another state dir is running
    # (checked by its pidfile: sinfo takes ~10 s to give up when nothing runs).
    local other
    other=$(sed -n 's/^SlurmctldPidFile=//p' "$CONF_DIR/slurm.conf" 2>/dev/null || true)
    if [[ -n $other && $other != "$RUN/slurmctld.pid" && -s $other ]] && pid_is "$(head -n1 "$other")" slurmctld; then
        die "a cluster with state in ${other%/run/slurmctld.pid} is running; run 'down' for it first"
    fi
    local t0=$SECONDS
    install_packages
    CONFIG_CHANGED=0
    write_config
    if ((CONFIG_CHANGED)); then
        # Running daemons would keep the old config: restart them (started again below).
        stop_daemon slurmd
        stop_daemon slurmctld
        stop_daemon slurmdbd
    fi
    start_munged
    start_mariadb
    start_slurmdbd
    setup_accounts # before slurmctld, so it registers with an existing cluster
    start_slurmctld
    start_slurmd
    wait_idle
    wait_for 30 sacct sacct -n -X || fail "sacct does not work"
    log "cluster up in $((SECONDS - t0)) s: partition/account $PARTITION, state in $STATE_DIR"
}

stop_daemon() { # stop_daemon NAME: SIGTERM the recorded pid, wait, SIGKILL after 30 s
    local name=$1 f pid i
    f=$(pidfile_of "$name")
    if [[ ! -s $f ]]; then return 0; fi
    pid=$(head -n1 "$f")
    if ! pid_is "$pid" "$name"; then
        # Stale pidfile (or a reused pid that is now something else): leave that alone.
        rm -f "$f"
        return 0
    fi
    log "stopping $name (pid $pid)"
    kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < 60; i++)); do
        pid_is "$pid" "$name" || break
        sleep 0.5
    done
    if pid_is "$pid" "$name"; then
        log "$name did not exit after 30 s; SIGKILL"
        kill -KILL "$pid" 2>/dev/null || true
        for ((i = 0; i < 20; i++)); do
            pid_is "$pid" "$name" || break
            sleep 0.5
        done
    fi
    pid_is "$pid" "$name" && die "$name (pid $pid) still running"
    rm -f "$f"
}

cmd_down() {
    [[ $(id -u) == 0 ]] || die "must run as root"
    set_paths
    # Cancel jobs first, so no slurmstepd/job processes outlive slurmd.
    if running slurmctld && timeout 10 squeue -h -o %i >/dev/null 2>&1; then
        local jobs
        jobs=$(timeout 10 squeue -h -o %i 2>/dev/null | tr '\n' ' ')
        if [[ -n ${jobs// /} ]]; then
            log "cancelling jobs: $jobs"
            # shellcheck disable=SC2086
            scancel $jobs 2>/dev/null || true
            # shellcheck disable=SC2016 # expanded by the inner bash, on each poll
            wait_for 30 "jobs to end" bash -c '[[ -z $(squeue -h -t R,CG,PD -o %i) ]]' || true
        fi
    fi
    # Reverse start order: slurmd before slurmctld; slurmdbd before its database.
    local d
    for d in slurmd slurmctld slurmdbd mariadbd munged; do
        stop_daemon "$d"
    done
    # Leave no client config pointing at a controller that is gone: with it, every SLURM
    # client command waits ~9 s before giving up, and snakemake's SLURM executor plugin runs
    # `scontrol show config` when it is imported, i.e. in every `snakemake` invocation on this
    # machine. Without it they fail at once. `up` writes it again.
    if grep -qx "ClusterName=$CLUSTER" "$CONF_DIR/slurm.conf" 2>/dev/null; then
        rm -f "$CONF_DIR/slurm.conf"
        log "removed $CONF_DIR/slurm.conf"
    fi
    log "cluster down"
}

cmd_status() {
    # scontrol ping fails at once when nothing listens; sinfo would retry ~10 s.
    if scontrol ping >/dev/null 2>&1 && timeout 10 sinfo -h -o '%P %T %D' 2>/dev/null | grep -q .; then
        sinfo -h -o 'partition %P: %D node(s) %T'
        return 0
    fi
    echo "[cluster.sh] cluster does not answer"
    return 1
}

case $ACTION in
up) cmd_up ;;
down) cmd_down ;;
status) cmd_status ;;
*) usage ;;
esac
