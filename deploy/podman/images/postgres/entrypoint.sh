#!/bin/sh
# The PostgreSQL stand-in's start. On a volume without a cluster: a new one whose superuser is POSTGRES_USER
# (default postgres) with the password POSTGRES_PASSWORD (required), and the database POSTGRES_DB (default the user's
# name). Then the server, on every address; connections from other hosts must give the password.
set -eu
: "${POSTGRES_USER:=postgres}"
: "${POSTGRES_DB:=$POSTGRES_USER}"
if [ -z "${POSTGRES_PASSWORD:-}" ]; then
  echo "postgres-entrypoint: POSTGRES_PASSWORD is not set; the server is not started" >&2
  exit 1
fi
if [ ! -s "$PGDATA/PG_VERSION" ]; then
  password="$(mktemp)"
  printf '%s' "$POSTGRES_PASSWORD" > "$password"
  initdb --username="$POSTGRES_USER" --pwfile="$password" --auth-local=trust --auth-host=scram-sha-256 \
    --encoding=UTF8 --pgdata="$PGDATA" >/dev/null
  rm -f "$password"
  echo "host all all all scram-sha-256" >> "$PGDATA/pg_hba.conf"
  if [ "$POSTGRES_DB" != postgres ]; then
    # single-user mode: no server listens until the database exists
    echo "CREATE DATABASE \"$POSTGRES_DB\" OWNER \"$POSTGRES_USER\";" \
      | postgres --single -j -D "$PGDATA" postgres >/dev/null
  fi
fi
exec postgres -D "$PGDATA" -c listen_addresses='*'
