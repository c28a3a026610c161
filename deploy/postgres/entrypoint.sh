#!/bin/sh
# The entry point of deploy/postgres/Containerfile: the official postgres image's environment
# contract, in a few lines. Started as root (Compose), it makes PGDATA the postgres user's and
# runs itself again as that user; started as uid 999 (Kubernetes' runAsUser), it goes on.
set -eu
: "${PGDATA:=/var/lib/postgresql/data}"
if [ "$(id -u)" = 0 ]; then
  mkdir -p "$PGDATA" /var/run/postgresql
  chown -R postgres:postgres "$PGDATA" /var/run/postgresql
  chmod 0700 "$PGDATA"
  exec setpriv --reuid=postgres --regid=postgres --init-groups "$0" "$@"
fi
if [ "${1:-postgres}" != postgres ] && [ "${1#-}" = "$1" ]; then
  exec "$@"   # another command (psql, a shell): as it is
fi
[ "${1:-}" = postgres ] && shift
if [ ! -s "$PGDATA/PG_VERSION" ]; then
  : "${POSTGRES_PASSWORD:?POSTGRES_PASSWORD must be set (the password of POSTGRES_USER)}"
  user=${POSTGRES_USER:-postgres}
  db=${POSTGRES_DB:-$user}
  pwfile=$(mktemp)
  printf '%s\n' "$POSTGRES_PASSWORD" > "$pwfile"
  initdb --username="$user" --pwfile="$pwfile" --auth-local=scram-sha-256 --auth-host=scram-sha-256 \
    --encoding=UTF8 --locale=C.UTF-8 -D "$PGDATA" > /dev/null
  rm -f "$pwfile"
  printf '\nhost all all 0.0.0.0/0 scram-sha-256\nhost all all ::/0 scram-sha-256\n' >> "$PGDATA/pg_hba.conf"
  if [ "$db" != postgres ]; then
    postgres --single -D "$PGDATA" -c listen_addresses='' postgres <<SQL > /dev/null
CREATE DATABASE "$db" OWNER "$user";
SQL
  fi
  echo "rev88-postgres: initialised $PGDATA (role $user, database $db)"
fi
socket_dir=/var/run/postgresql
if [ ! -w "$socket_dir" ]; then  # (a volume there that this user cannot write: podman's emptyDir, say)
  socket_dir=$(mktemp -d)
  echo "rev88-postgres: /var/run/postgresql is not writable by uid $(id -u); the socket goes to $socket_dir"
fi
exec postgres -c listen_addresses='*' -c unix_socket_directories="$socket_dir" "$@"
