#!/bin/sh
# The S3 stand-in's start: moto's S3 server on port 9000, and the buckets S3_BUCKETS names (space-separated) made
# as soon as it answers. The server keeps everything in memory, so the buckets are made again at every start (a
# one-shot run once would leave a restarted server without them). Credentials: any value is accepted.
set -eu
export AWS_ACCESS_KEY_ID="${MINIO_ROOT_USER:-stand-in}" AWS_SECRET_ACCESS_KEY="${MINIO_ROOT_PASSWORD:-stand-in}"
(for bucket in ${S3_BUCKETS:-}; do python3 /opt/s3/make_bucket.py http://127.0.0.1:9000 "$bucket"; done) &
exec moto_server -H 0.0.0.0 -p 9000
