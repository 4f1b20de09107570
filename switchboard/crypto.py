"""Tokens and their hashes, ids, and webhook secrets sealed with the key file."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import os
import re
import secrets
import threading
import time
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from switchboard.configuration import ApiError
from switchboard.database import Txn

_last_id = 0
_last_id_lock = threading.Lock()


def new_id(prefix: str) -> str:
    """`prefix_` and 20 hex digits: the creation millisecond (48 bits), then 32 random bits, and in this process
    always greater than the id before it. Ids are names, never credentials (tokens are). Made in time order, a new
    row's key lands beside the last one's in every index keyed by an id, so a commit of many deliveries dirties a
    few pages at the right edge of each index, not one random page per row (fewer pages to write and sync)."""
    global _last_id
    value = (time.time_ns() // 1_000_000) << 32 | secrets.randbits(32)
    with _last_id_lock:
        value = _last_id = max(value, _last_id + 1)
    return f"{prefix}_{value:020x}"


def new_token(prefix: str) -> str:
    """A bearer token with 256 bits of randomness; only its SHA-256 is ever stored."""
    return f"{prefix}_{secrets.token_urlsafe(32)}"


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def hashes_match(stored: str | None, presented: str) -> bool:
    return stored is not None and hmac.compare_digest(stored, token_hash(presented))


class KeyMismatch(ApiError):
    """The secret key and the database do not belong together: a start error and a `check` failure."""

    def __init__(self, message: str):
        super().__init__("unavailable", message)


def sealed_sample(txn: Txn) -> tuple[str, bytes] | None:
    """One sealed credential the database holds (a webhook secret, else a notification channel's URL, else a forge
    connection's token), to prove a key against."""
    row = txn.one("SELECT id, secret_sealed FROM webhooks WHERE secret_sealed IS NOT NULL LIMIT 1")
    if row is None and txn.has_table("notify_channels"):
        row = txn.one("SELECT id, url_sealed AS secret_sealed FROM notify_channels LIMIT 1")
    if row is None and txn.has_table("forge_connections"):
        row = txn.one("SELECT id, token_sealed AS secret_sealed FROM forge_connections LIMIT 1")
    return (row["id"], row["secret_sealed"]) if row else None


class SecretBox:
    """AES-256-GCM for webhook secrets at rest. The key comes from $SWITCHBOARD_SECRET_KEY (32 bytes, base64
    or hex) or from a key file beside the database, created with mode 0600 on first use."""

    NONCE_BYTES = 12

    def __init__(self, key: bytes):
        self._aead = AESGCM(key)

    @classmethod
    def for_database(cls, db_path: str, sealed: tuple[str, bytes] | None = None,
                     key_file: str | None = None) -> SecretBox:
        """The key for this database. `sealed` is one (webhook id, sealed secret) the database holds, if any:
        then a missing key file is not made anew and a key that cannot open it is refused, because either way
        every signed webhook would answer 503 with nothing to say why. `key_file` (--key-file,
        $SWITCHBOARD_KEY_FILE) names the file; without it the file is the one beside a SQLite database, and a
        Postgres URL, which has no beside, must name one (every process of it must use the same key)."""
        configured = os.environ.get("SWITCHBOARD_SECRET_KEY")
        key_file = key_file or os.environ.get("SWITCHBOARD_KEY_FILE") or None
        if not configured and key_file is None and db_path.startswith(("postgresql://", "postgres://")):
            raise ApiError("invalid_argument", "a Postgres database needs its key named: --key-file PATH (or"
                                               " SWITCHBOARD_KEY_FILE, or the key itself in SWITCHBOARD_SECRET_KEY),"
                                               " the same file on every process")
        path = Path(key_file).resolve() if key_file else key_file_path(db_path)
        db_path = shown(db_path)
        if configured:
            box, where = cls(parse_key(configured)), "$SWITCHBOARD_SECRET_KEY"
        elif sealed is not None and not path.exists():
            raise KeyMismatch(f"{db_path} holds sealed webhook secrets but the key file {path} is missing: restore"
                              " switchboard.key from the backup beside the database (or set SWITCHBOARD_SECRET_KEY);"
                              " a new key cannot open them")
        else:
            box, where = cls(load_or_create_key_file(path)), str(path)
        if sealed is not None and not box.opens(*sealed):
            raise KeyMismatch(f"the key in {where} does not open the webhook secrets in {db_path}: use the key"
                              " that was in use when this database was written")
        return box

    def opens(self, webhook_id: str, sealed: bytes) -> bool:
        try:
            self.open(sealed, webhook_id)
        except ApiError:
            return False
        return True

    def seal(self, secret: str, bound_to: str) -> bytes:
        nonce = secrets.token_bytes(self.NONCE_BYTES)
        return nonce + self._aead.encrypt(nonce, secret.encode(), bound_to.encode())

    def open(self, sealed: bytes, bound_to: str) -> bytes:
        try:
            return self._aead.decrypt(sealed[:self.NONCE_BYTES], sealed[self.NONCE_BYTES:], bound_to.encode())
        except InvalidTag:
            raise ApiError("unavailable", "webhook secret cannot be decrypted with this key") from None


def parse_key(text: str) -> bytes:
    text = text.strip()
    candidates = []
    if re.fullmatch(r"[0-9a-fA-F]{64}", text):
        candidates.append(bytes.fromhex(text))
    with contextlib.suppress(ValueError):
        candidates.append(base64.b64decode(text, validate=True))
    with contextlib.suppress(ValueError):
        candidates.append(base64.urlsafe_b64decode(text))
    for key in candidates:
        if len(key) == 32:
            return key
    raise ApiError("invalid_argument", "SWITCHBOARD_SECRET_KEY must be 32 bytes in base64 or hex")


def shown(db_path: str) -> str:
    """A database as a message may name it: a URL's password is left out."""
    return re.sub(r"(://[^:/@]+):[^@]*@", r"\1:***@", db_path)


def key_file_path(db_path: str) -> Path:
    return Path(db_path).resolve().with_name("switchboard.key")


def load_or_create_key_file(path: Path) -> bytes:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return parse_key(path.read_text())
    with os.fdopen(fd, "w") as handle:
        handle.write(base64.b64encode(secrets.token_bytes(32)).decode() + "\n")
        handle.flush()
        os.fsync(handle.fileno())
    return parse_key(path.read_text())
