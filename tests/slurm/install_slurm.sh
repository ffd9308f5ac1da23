#!/bin/bash
# Debian's Slurm 22.05 (slurmctld, slurmd, slurm-client) and munge for `make test-slurm`, installed if missing.
# Needs root and apt-get. The packages' own services must not start (they would read /etc/slurm and take the
# system's munge socket): where no /usr/sbin/policy-rc.d forbids that already, one does during the install.
set -euo pipefail

packages=(slurmctld slurmd slurm-client munge)
command -v ps > /dev/null || packages+=(procps)  # slurm/node_launch.sh finds the training processes with ps
missing=()
for package in "${packages[@]}"; do
    dpkg-query -W -f '${Status}' "$package" 2> /dev/null | grep -q "install ok installed" || missing+=("$package")
done
[ "${#missing[@]}" -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get > /dev/null; then
    echo "error: make test-slurm installs ${missing[*]} with apt-get as root, and runs slurmd as root" >&2
    exit 2
fi
if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d
    chmod 755 /usr/sbin/policy-rc.d
    trap 'rm -f /usr/sbin/policy-rc.d' EXIT
fi
apt-get update -q
DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
