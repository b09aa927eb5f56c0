"""A real S3-compatible server on loopback for the object-store tests: moto's server mode.

`moto_s3()` starts `moto.server.ThreadedMotoServer` on 127.0.0.1 at a free port, creates a
bucket, and points every S3 client of this process (boto3, s3fs, zarr's FsspecStore) at it
through AWS_ENDPOINT_URL and fake credentials; `env` carries the same settings to
subprocesses. Nothing leaves the machine. `serve_s3` (the body of a test module's `s3`
fixture) skips when moto or s3fs are missing (they come with the `dev` extra).
"""

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest

BUCKET = "dflash-test"


@dataclass
class S3Endpoint:
    """A running moto S3 server and the bucket the tests write to."""

    endpoint: str
    """http://127.0.0.1:PORT"""
    bucket: str
    """Bucket created at start."""
    env: dict[str, str]
    """Environment that points S3 clients at the server (for subprocesses too)."""

    def url(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    def keys(self, prefix: str) -> list[str]:
        """Object keys under `prefix`, listed fresh from the server."""
        import boto3

        client = boto3.client("s3", endpoint_url=self.endpoint)
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket,
                                                                 Prefix=prefix)
        return [o["Key"] for page in pages for o in page.get("Contents", [])]


def _forget_s3_clients() -> None:
    """Close and drop cached s3fs instances, so the next one reads the endpoint from the
    environment (and no unclosed aiohttp session is reported at exit)."""
    import s3fs
    from zarr.core.sync import sync

    for fs in list(s3fs.S3FileSystem._cache.values()):
        if getattr(fs, "_s3", None) is not None:
            # zarr's FsspecStore makes asynchronous instances on zarr's own event loop
            if fs.asynchronous:
                sync(fs._s3.__aexit__(None, None, None))
            else:
                s3fs.S3FileSystem.close_session(fs.loop, fs._s3)
    s3fs.S3FileSystem.clear_instance_cache()


@contextmanager
def moto_s3(bucket: str = BUCKET) -> Iterator[S3Endpoint]:
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one log line per request
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        env = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing",
               "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
               "AWS_EC2_METADATA_DISABLED": "true"}
        with pytest.MonkeyPatch.context() as mp:
            for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN"):
                mp.delenv(name, raising=False)
            for name, value in env.items():
                mp.setenv(name, value)
            import boto3

            boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
            _forget_s3_clients()
            yield S3Endpoint(endpoint=endpoint, bucket=bucket, env=env)
            _forget_s3_clients()
    finally:
        server.stop()


def serve_s3() -> Iterator[S3Endpoint]:
    """Body of an `s3` fixture: skip without moto / s3fs, else a server for the scope."""
    pytest.importorskip("moto.server", reason="moto[server] is in the dev extra")
    pytest.importorskip("s3fs", reason="s3fs is in the s3 / dev extras")
    with moto_s3() as endpoint:
        yield endpoint


def subprocess_env(endpoint: S3Endpoint, **extra: str) -> dict[str, str]:
    """This process's environment plus the server's settings, for a child process."""
    return {**os.environ, **endpoint.env, **extra}
