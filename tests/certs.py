"""TLS material for tests: one trustme CA per test session, never files in the repo."""

from __future__ import annotations

import datetime
import functools
import ssl

import trustme


@functools.cache
def ca() -> trustme.CA:
    return trustme.CA()


@functools.cache
def server_cert(*identities: str) -> trustme.LeafCert:
    return ca().issue_cert(*(identities or ("localhost", "127.0.0.1", "::1")))


@functools.cache
def client_cert() -> trustme.LeafCert:
    return ca().issue_cert("client@example.org")


@functools.cache
def expired_server_cert() -> trustme.LeafCert:
    now = datetime.datetime.now(datetime.timezone.utc)
    return ca().issue_cert(
        "localhost",
        "127.0.0.1",
        not_before=now - datetime.timedelta(days=10),
        not_after=now - datetime.timedelta(days=1),
    )


def _pin(context: ssl.SSLContext, version: ssl.TLSVersion | None) -> ssl.SSLContext:
    if version is not None:
        context.minimum_version = version
        context.maximum_version = version
    return context


def server_context(
    version: ssl.TLSVersion | None = None,
    *,
    cert: trustme.LeafCert | None = None,
    require_client_cert: bool = False,
) -> ssl.SSLContext:
    """A server context for ``localhost`` / ``127.0.0.1`` / ``::1`` signed by the test CA."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    (cert or server_cert()).configure_cert(context)
    if require_client_cert:
        context.verify_mode = ssl.CERT_REQUIRED
        ca().configure_trust(context)
    return _pin(context, version)


def client_context(
    version: ssl.TLSVersion | None = None, *, with_cert: bool = False, trust: bool = True
) -> ssl.SSLContext:
    """A client context trusting the test CA (unless ``trust=False``)."""
    context = ssl.create_default_context()
    if trust:
        ca().configure_trust(context)
    if with_cert:
        client_cert().configure_cert(context)
    return _pin(context, version)
