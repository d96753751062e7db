#!/bin/sh
# A training host's sshd in the foreground: the host key and the one authorized key come from
# $SYNCSWITCH_SSH_DIR (the deployment's secrets), never from the image. Logins: user trainer, key only.
set -eu
ssh_dir="${SYNCSWITCH_SSH_DIR:-/opt/airflow/secrets/ssh}"
for file in host_ed25519_key authorized_keys; do
    [ -s "$ssh_dir/$file" ] || { echo "trainer-sshd: no $ssh_dir/$file (airflow-init makes it)" >&2; exit 1; }
done
exec /usr/sbin/sshd -D -e \
    -o "HostKey=$ssh_dir/host_ed25519_key" \
    -o "AuthorizedKeysFile=$ssh_dir/authorized_keys" \
    -o PasswordAuthentication=no -o KbdInteractiveAuthentication=no -o PermitRootLogin=no \
    -o AllowUsers=trainer -o PermitUserEnvironment=no -o UsePAM=no
