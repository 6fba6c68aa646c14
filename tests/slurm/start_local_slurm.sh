#!/bin/bash
# A one-node Slurm cluster on this machine (127.0.0.1): munged, slurmctld and slurmd, no systemd,
# no cgroups. Needs root and Debian's packages: apt-get install -y slurm-wlm munge.
# Idempotent: daemons already running are left alone. Used by `make test-slurm`.
set -euo pipefail
CPUS=${SLURM_LOCAL_CPUS:-2}
STATE=/var/spool/slurmctld
for bin in munged slurmctld slurmd sbatch; do
  command -v "$bin" >/dev/null || { echo "error: $bin not found: apt-get install -y slurm-wlm munge" >&2; exit 2; }
done
mkdir -p /etc/munge /var/lib/munge /var/log/munge /run/munge "$STATE" /var/spool/slurmd /var/log/slurm
if [ ! -s /etc/munge/munge.key ]; then
  dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key status=none
fi
chown -R munge:munge /etc/munge /var/lib/munge /var/log/munge /run/munge 2>/dev/null || true
chmod 0700 /etc/munge && chmod 0400 /etc/munge/munge.key
pgrep -x munged >/dev/null || runuser -u munge -- /usr/sbin/munged --force
MEM=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 / 2 ))
cat > /etc/slurm/slurm.conf <<CONF
ClusterName=local
SlurmctldHost=localhost(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation=$STATE
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
MpiDefault=none
SwitchType=switch/none
JobRequeue=1
NodeName=localhost NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$MEM State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
CONF
: > /etc/slurm/cgroup.conf
pgrep -x slurmctld >/dev/null || /usr/sbin/slurmctld
pgrep -x slurmd >/dev/null || /usr/sbin/slurmd -N localhost
for _ in $(seq 30); do  # the node registers within a few seconds
  if sinfo -h -N -o '%T' 2>/dev/null | grep -qE '^(idle|mixed|allocated)'; then
    sinfo; exit 0
  fi
  sleep 1
done
echo "error: the node did not come up in 30 s; logs: /var/log/slurm/slurmctld.log, slurmd.log" >&2
sinfo -N -l >&2 || true
tail -20 /var/log/slurm/slurmctld.log /var/log/slurm/slurmd.log >&2 || true
exit 1
