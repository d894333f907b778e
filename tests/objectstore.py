"""A real S3-compatible server for tests: moto's server mode (`python -m moto.server`) on a free
loopback port, spoken to over HTTP by the same s3fs/botocore client the trainer uses. Not a mock
of the client: requests go through botocore's signing, retries and XML parsing."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

from finetune_operator.api.storage import ObjectStoreSpec

# moto accepts any keys; real ones are never needed (nor present) in tests.
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "test-access-key", "AWS_SECRET_ACCESS_KEY": "test-secret-key"}
REGION = "eu-west-1"


class MotoServer:
    def __init__(self, host: str = "127.0.0.1", log: Path | None = None) -> None:
        with socket.socket() as s:
            s.bind((host, 0))
            self.port = int(s.getsockname()[1])
        self.host = host
        out = open(log, "wb") if log else subprocess.DEVNULL  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", host, "-p", str(self.port)],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{self.endpoint}/moto-api/", timeout=2).close()
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.close()
                    raise RuntimeError("moto server did not start") from None
                time.sleep(0.1)

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    def spec(self) -> ObjectStoreSpec:
        return ObjectStoreSpec(endpoint_url=self.endpoint, region=REGION, path_style=True)

    def new_bucket(self) -> str:
        import boto3

        name = f"test-{uuid.uuid4().hex[:12]}"
        client = boto3.client(
            "s3", endpoint_url=self.endpoint, region_name=REGION,
            aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        )  # fmt: skip
        client.create_bucket(Bucket=name, CreateBucketConfiguration={"LocationConstraint": REGION})
        return name

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


@contextlib.contextmanager
def moto_server(host: str = "127.0.0.1", log: Path | None = None) -> Iterator[MotoServer]:
    server = MotoServer(host, log)
    try:
        yield server
    finally:
        server.close()
