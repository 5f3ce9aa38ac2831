"""The S3 stand-in's bucket one-shot: makes a bucket at an endpoint (kept when it exists), then exits 0.

    python3 make_bucket.py ENDPOINT BUCKET      credentials from AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY

It waits up to 60 s for the endpoint to answer (serve.sh runs it beside the starting server; the compose start
has no health conditions to wait on) and exits 1, saying why, when it never does.
"""

import sys
import time

import boto3
from botocore.exceptions import ClientError, EndpointConnectionError

WAIT_S = 60


def main(endpoint: str, bucket: str) -> int:
    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    deadline = time.monotonic() + WAIT_S
    while True:
        try:
            s3.create_bucket(Bucket=bucket)
            print(f"made bucket {bucket} at {endpoint}")
            return 0
        except ClientError as exc:
            if exc.response["Error"]["Code"] in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                print(f"bucket {bucket} at {endpoint} is there")
                return 0
            raise
        except EndpointConnectionError:
            if time.monotonic() > deadline:
                print(f"make_bucket: {endpoint} did not answer within {WAIT_S} s", file=sys.stderr)
                return 1
            time.sleep(0.5)


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
