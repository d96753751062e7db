# Sourced by test.sh: the system packages some tests drive, installed when missing and we are root on
# Debian/Ubuntu (as in CI). Without them those tests skip and say why.
#   chromium          the Trigger-form test (a real browser on the real Airflow UI)
#   openssh-server    the multi-host testbed (an sshd per network namespace)
#   iptables          the testbed's isolation rules
#   postgresql        the distributed deployment's metadata database (testing/celery_deployment.py)
#   redis-server      its Celery broker
#   docker.io         the compose stack and the Python 3.13 install check (a Docker engine)
#   debootstrap       their stand-in base images, where no image registry is reachable
missing=()
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
[ -x /usr/sbin/sshd ] || missing+=(openssh-server)
command -v iptables >/dev/null 2>&1 || missing+=(iptables)
ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || missing+=(postgresql)
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
command -v dockerd >/dev/null 2>&1 || missing+=(docker.io)
command -v debootstrap >/dev/null 2>&1 || missing+=(debootstrap)
if [ "${#missing[@]}" -gt 0 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing system packages for the tests: ${missing[*]}" >&2
    # Keep the packages' services (a machine-wide sshd) from starting during the install.
    own_policy=""
    if [ ! -e /usr/sbin/policy-rc.d ]; then
        printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d
        own_policy=1
    fi
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq "${missing[@]}" >/dev/null 2>&1 \
        || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq "${missing[@]}" >/dev/null; } \
        || echo "could not install ${missing[*]}; the tests that need them will skip" >&2
    if [ -n "$own_policy" ]; then rm -f /usr/sbin/policy-rc.d; fi
fi
true
