"""Device secrets: the salted hash the control plane checks a device's HTTP credentials against,
and the PBKDF2 form Mosquitto's password file takes (control_plane/mosquitto_files.py writes it)."""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets


def _hash_secret(secret: str, salt: bytes | None = None, kind: str = "sha256") -> str:
    """A salted hash of a device secret. The secrets are 192-bit random tokens, which no guessing
    reaches, so a fast keyed hash (HMAC-SHA256) is as safe as a slow one and lets the control
    plane check a fleet's requests without spending ~70 ms of CPU each (a slow KDF is for secrets
    people choose). Stores made earlier hold scrypt hashes, which are still checked."""
    salt = salt or secrets.token_bytes(16)
    if kind == "scrypt":
        digest = hashlib.scrypt(secret.encode(), salt=salt, n=2**14, r=8, p=1, dklen=32)
    else:
        digest = hmac.new(salt, secret.encode(), hashlib.sha256).digest()
    return f"{kind}${base64.b64encode(salt).decode()}${base64.b64encode(digest).decode()}"


def mosquitto_hash(secret: str) -> str:
    """The secret as a Mosquitto 2 password file stores it ($7$: PBKDF2-SHA512, 101 rounds, 12-byte salt)."""
    salt = secrets.token_bytes(12)
    digest = hashlib.pbkdf2_hmac("sha512", secret.encode(), salt, 101, 64)
    return f"$7$101${base64.b64encode(salt).decode()}${base64.b64encode(digest).decode()}"




def check_secret(secret: str, stored: str) -> bool:
    try:
        kind, salt, _ = stored.split("$")
        if kind not in ("sha256", "scrypt"):
            return False
        return hmac.compare_digest(_hash_secret(secret, base64.b64decode(salt), kind), stored)
    except ValueError:
        return False
