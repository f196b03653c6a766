#!/usr/bin/env bash
# A real 3-node Slurm on this machine for the tests and bench/slurm.py (as root; Debian's Slurm 22.05 and munge):
#   scripts/slurm.sh start   install what is missing, wipe old state, start munged, slurmctld and
#                            `slurmd -N node1..3` (ports 17001-17003 on 127.0.0.1), wait for 3 idle nodes
#   scripts/slurm.sh stop    cancel every job, stop the daemons, kill leftover step daemons and munged
# The configuration is testing/slurm/slurm.conf (short timeouts, no cgroups: proctrack/linuxproc), or ELASTIC_SLURM_CONF
# (testing/slurm/gpu-site.conf: a GPU site's, whose GRES GPUs testing/slurm/gres.conf lists: /dev/fakegpu0-1, made here).
set -euo pipefail
HERE=$(cd "$(dirname "$0")/.." && pwd)
CONF=${ELASTIC_SLURM_CONF:-$HERE/testing/slurm/slurm.conf}
NODES=(node1 node2 node3)
alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

install_packages() {
  command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
    && command -v munged >/dev/null && return
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
}

start() {
  [ "$(id -u)" = 0 ] || { echo "scripts/slurm.sh: must run as root (it starts slurmctld, slurmd and munged)" >&2; exit 1; }
  install_packages
  install -D -m 644 "$CONF" /etc/slurm/slurm.conf
  if grep -q '^GresTypes=gpu' "$CONF"; then  # a GPU site's: its GPUs stand as character devices (/dev/null's numbers)
    install -m 644 "$HERE/testing/slurm/gres.conf" /etc/slurm/gres.conf
    for i in 0 1; do [ -e "/dev/fakegpu$i" ] || mknod "/dev/fakegpu$i" c 1 3; done
  else
    rm -f /etc/slurm/gres.conf
  fi
  mkdir -p /var/spool/slurmctld /var/spool/slurmd /var/log/slurm /run/munge /var/log/munge /var/lib/munge
  rm -rf /var/spool/slurmctld/* /var/spool/slurmd/*
  for n in "${NODES[@]}"; do mkdir -p "/var/spool/slurmd/$n"; done
  [ -s /etc/munge/munge.key ] || /usr/sbin/mungekey --create --keyfile=/etc/munge/munge.key
  chown munge:munge /etc/munge /etc/munge/munge.key /run/munge /var/log/munge /var/lib/munge
  chmod 700 /etc/munge; chmod 600 /etc/munge/munge.key; chmod 755 /run/munge
  alive /run/munge/munged.pid || runuser -u munge -- /usr/sbin/munged
  for _ in $(seq 50); do munge -n </dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
  alive /run/slurmctld.pid || /usr/sbin/slurmctld
  for n in "${NODES[@]}"; do alive "/run/slurmd-$n.pid" || /usr/sbin/slurmd -N "$n"; done
  local end=$((SECONDS + ${ELASTIC_SLURM_START_TIMEOUT:-60}))
  until [ "$(sinfo -h -N -t idle -o '%N' 2>/dev/null | sort -u | wc -l)" -eq "${#NODES[@]}" ]; do
    if [ $SECONDS -ge $end ]; then
      echo "scripts/slurm.sh: the nodes did not become idle" >&2; sinfo -N >&2 || true
      tail -n 20 /var/log/slurm/slurmctld.log >&2 || true; exit 1
    fi
    sleep 0.2
  done
}

stop() {
  local pids="" end p f
  if alive /run/slurmctld.pid; then
    jobs=$(squeue -h -o '%A' 2>/dev/null || true); [ -z "$jobs" ] || scancel --quiet $jobs || true
    end=$((SECONDS + 20))
    while [ -n "$(squeue -h -o '%A' 2>/dev/null || true)" ] && [ $SECONDS -lt $end ]; do sleep 0.2; done
  fi
  for f in /run/slurmctld.pid $(printf '/run/slurmd-%s.pid ' "${NODES[@]}"); do
    if alive "$f"; then p=$(cat "$f"); kill -TERM "$p"; pids="$pids $p"; fi
    rm -f "$f"
  done
  end=$((SECONDS + 15))
  for p in $pids; do
    while kill -0 "$p" 2>/dev/null; do [ $SECONDS -ge $end ] && kill -KILL "$p"; sleep 0.1; done
  done
  for p in /proc/[0-9]*; do  # step daemons left by a slurmd that was killed: the exact binary, by pid
    case "$(readlink "$p/exe" 2>/dev/null)" in /usr/sbin/slurmstepd*) kill -KILL "${p#/proc/}" 2>/dev/null || true;; esac
  done
  if [ "${ELASTIC_SLURM_KEEP_MUNGE:-0}" != 1 ] && alive /run/munge/munged.pid; then
    p=$(cat /run/munge/munged.pid); kill -TERM "$p"
    for _ in $(seq 50); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
  fi
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  *) echo "usage: scripts/slurm.sh start|stop" >&2; exit 2 ;;
esac
