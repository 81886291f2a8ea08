"""A real S3 server on 127.0.0.1 for the object-store tests: moto's server mode (an HTTP server speaking S3's wire
protocol, conditional writes included), started in this process; clients reach it through the standard AWS
environment variables (``AWS_ENDPOINT_URL`` and credentials), as replicas on a cluster reach a real bucket."""

from __future__ import annotations

import json
import logging
import secrets
from contextlib import contextmanager

BUCKET = "statekv-test"


class S3Server:
    """moto's S3 server on a free port of 127.0.0.1, with one bucket (`BUCKET`)."""

    def __init__(self):
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.server.start()
        host, port = self.server.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"
        self.env = {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": "testing",
                    "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
        self.client().create_bucket(Bucket=BUCKET)

    def client(self, **credentials):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                            aws_access_key_id=credentials.get("key", "testing"),
                            aws_secret_access_key=credentials.get("secret", "testing"))

    def url(self, prefix: str | None = None) -> str:
        """A fresh prefix of the bucket, as ``--store`` takes it."""
        return f"s3://{BUCKET}/{prefix or secrets.token_hex(6)}"

    def names(self, url: str) -> list[str]:
        """Every object's name under ``url``'s prefix."""
        prefix = url.split(f"s3://{BUCKET}/", 1)[1].rstrip("/") + "/"
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
        return sorted(item["Key"][len(prefix):] for page in pages for item in page.get("Contents", []))

    @contextmanager
    def writes_refused_to(self, monkeypatch):
        """Within: the bucket refuses every write and deletion of the credentials it hands out (an IAM policy
        denying them, checked by the server on each request), reads still allowed. The environment's
        credentials are those of a user the policy applies to."""
        import boto3

        def iam_client(key: str = "testing", secret: str = "testing"):
            return boto3.client("iam", endpoint_url=self.endpoint, region_name="us-east-1",
                                aws_access_key_id=key, aws_secret_access_key=secret)

        iam, suffix = iam_client(), secrets.token_hex(4)
        admin, user = f"admin-{suffix}", f"statekv-{suffix}"  # the admin changes the user's policy once it counts
        everything = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}
        allow = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}
        for name, policy in ((admin, everything), (user, allow)):
            iam.create_user(UserName=name)
            iam.put_user_policy(UserName=name, PolicyName="all", PolicyDocument=json.dumps(policy))
        admin_key = iam.create_access_key(UserName=admin)["AccessKey"]
        key = iam.create_access_key(UserName=user)["AccessKey"]
        iam = iam_client(admin_key["AccessKeyId"], admin_key["SecretAccessKey"])
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", key["AccessKeyId"])
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", key["SecretAccessKey"])
        deny = {"Version": "2012-10-17", "Statement": [
            {"Effect": "Allow", "Action": "s3:*", "Resource": "*"},
            {"Effect": "Deny", "Action": ["s3:PutObject", "s3:DeleteObject"], "Resource": "*"}]}

        def refuse(refused: bool) -> None:
            iam.put_user_policy(UserName=user, PolicyName="all", PolicyDocument=json.dumps(deny if refused else allow))

        self._auth(0)  # from now on every request is checked against its user's policies
        try:
            yield refuse
        finally:
            self._auth(float("inf"))

    @staticmethod
    def _auth(after: float) -> None:
        """Check each request's signature and its user's policies after ``after`` more requests (inf: never); the
        server runs in this process, so its setting is set here."""
        from moto import settings
        from moto.core.authorization import ActionAuthenticatorMixin

        settings.INITIAL_NO_AUTH_ACTION_COUNT = after
        ActionAuthenticatorMixin.request_count = 0

    def stop(self) -> None:
        self.server.stop()
