"""What client and controller agree on for authentication: the metadata that carries a
bearer token and the environment variables a client reads its credentials from."""

from __future__ import annotations

METADATA_KEY = "authorization"
TOKEN_ENV = "SLICEWISE_TOKEN"
# TLS for clients: the CA bundle that signed the controller's certificate, and for mutual
# TLS the client's own certificate chain and key (PEM files).
TLS_CA_ENV = "SLICEWISE_TLS_CA"
TLS_CERT_ENV = "SLICEWISE_TLS_CERT"
TLS_KEY_ENV = "SLICEWISE_TLS_KEY"


def bearer_header(token: str) -> tuple[str, str]:
    return (METADATA_KEY, f"Bearer {token}")
