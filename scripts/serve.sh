#!/usr/bin/env bash
# Start the replay service on local files (./replay-data) with the demo run loaded.
# Extra arguments go to `replay-service serve` (e.g. --port 9000, --host 0.0.0.0).
source "$(dirname "${BASH_SOURCE[0]}")/env.sh" service
cd "$root"
exec replay-service serve --data ./replay-data --demo "$@"
