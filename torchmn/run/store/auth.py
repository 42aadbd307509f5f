"""The job's secret: the token ``torchmn run`` makes for each job, and the greeting that proves it.

The launcher hands the token to its ranks in ``TORCHMN_JOB_TOKEN`` (to remote ranks through the
watcher's stdin, never on a command line, where every user of the host could read it in ``ps``).
The rendezvous store admits a connection from a process of its host started with the token, or
from another host's relay (``torchmn.run.store.relay``) that proves it knows the token with this
module's greeting:

1. the client sends ``GREETING_PREFIX`` (a first byte no ``TCPStore`` request starts with, then
   ``torchmn``), a kind byte (``KINDS``) and a random nonce of ``NONCE_SIZE`` bytes;
2. the server answers with a nonce of its own and ``proof(token, SERVER, both nonces)``;
3. the client checks that proof first, and closes the connection when it is wrong: a process
   that holds the job's port without the token (another user's, who bound it first) learns
   nothing and is told nothing;
4. the client answers ``proof(token, CLIENT, both nonces)``;
5. the server sends ``ACCEPTED`` and keeps the connection, or closes it. Each proof covers the
   kind too, so one kind's greeting cannot be turned into another's.

The proofs are HMACs, so the token never crosses the network; both sides' nonces make a
recorded proof worth nothing in the next greeting, and the role in each makes one side's proof
useless as the other's.

Standard library only: the watcher loads this module on hosts where torch must not be imported.
The trust model is in ``docs/security.md``.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import socket
import time
from typing import Callable, Mapping, Optional

from torchmn.environments.variables import JOB_TOKEN
from torchmn.errors import TorchmnError

# The variable that carries the token to every rank (and to what the rank starts); the ranks'
# side names it too, where a rank without it is told why the store refused it.
TOKEN_ENV = JOB_TOKEN
# Set on a remote rank's watcher: the first line of its stdin is the token (see token_line).
TOKEN_ON_STDIN = "TORCHMN_JOB_TOKEN_ON_STDIN"

# 0xff is no TCPStore request type, so the store's server tells a greeting from a plain
# TCPStore client by the first byte alone (a plain client speaks first and then waits).
GREETING_BYTE = b"\xff"
GREETING_PREFIX = GREETING_BYTE + b"torchmn"
# The kinds of greeted connection: another host's relay passing on one of its host's clients, or
# asking where the store takes signed connections directly (see torchmn.run.store.relay).
RELAY = b"R"
WHERE = b"W"
KINDS = (RELAY, WHERE)
GREETING = GREETING_PREFIX + RELAY
NONCE_SIZE = 32
PROOF_SIZE = 32
SERVER = b"server"  # the roles a proof is made for
CLIENT = b"client"
ACCEPTED = b"\x01"

# Shortest token taken from the environment (given to the launchers of one job, see shared_token): 128 bits in hex.
MIN_TOKEN_CHARS = 32


class TokenError(TorchmnError, OSError):
    """The other side did not accept this process's token, or the greeting went wrong."""


class ImpostorError(TokenError):
    """The server did not prove that it knows the job's token: not the job's gate (a process that
    holds the port without the token), or a gate of a job with another token."""


def new_token() -> str:
    """A fresh random token for one job.

    Returns:
        64 hexadecimal characters (256 random bits).

    Example::

        >>> len(new_token())
        64
    """
    return secrets.token_hex(32)


def store_key(token: str) -> bytes:
    """The key with which the kernel signs every TCP segment between the store and those who may
    reach it directly (``torchmn.run.store.rendezvous.sign``): the gate, and other hosts' relays.

    Args:
        token: the job's token.

    Returns:
        32 bytes, the same wherever the token is known.

    Example::

        >>> len(store_key("ab" * 32))
        32
    """
    return hmac.new(token.encode(), b"torchmn store signatures", hashlib.sha256).digest()


def proof(token: str, role: bytes, nonces: bytes, kind: bytes = RELAY) -> bytes:
    """One side's proof in the greeting: HMAC-SHA256 of the kind, its role and both nonces, keyed
    with the token.

    Args:
        token: the job's token.
        role: ``SERVER`` or ``CLIENT``.
        nonces: the client's nonce followed by the server's.
        kind: the kind of connection (``KINDS``).

    Returns:
        ``PROOF_SIZE`` bytes.

    Example::

        >>> len(proof("ab" * 32, CLIENT, bytes(2 * NONCE_SIZE)))
        32
    """
    return hmac.new(token.encode(), b"torchmn rendezvous " + kind + role + nonces, hashlib.sha256).digest()


def proof_matches(token: str, role: bytes, nonces: bytes, answer: bytes, kind: bytes = RELAY) -> bool:
    """Whether ``answer`` is the right proof, compared in constant time (``hmac.compare_digest``).

    Args:
        token: the job's token.
        role: the role the proof is for (``SERVER``, ``CLIENT``).
        nonces: the client's nonce followed by the server's.
        answer: what the other side sent.
        kind: the kind of connection.

    Returns:
        True when the other side knows the token.

    Example::

        >>> token, nonces = new_token(), os.urandom(2 * NONCE_SIZE)
        >>> right = proof(token, CLIENT, nonces)
        >>> proof_matches(token, CLIENT, nonces, right), proof_matches(token, CLIENT, nonces, bytes(32))
        (True, False)
        >>> proof_matches(token, CLIENT, nonces, proof(token, SERVER, nonces))  # no use as the other side's
        False
    """
    return hmac.compare_digest(proof(token, role, nonces, kind), answer)


def read_exactly(sock: socket.socket, size: int, interrupt: Optional[Callable[[], None]] = None,
                 deadline: Optional[float] = None) -> bytes:
    """Read ``size`` bytes from ``sock``.

    Args:
        sock: a connected, blocking socket.
        size: how many bytes.
        interrupt: called each time the socket's timeout passes without data, until ``deadline``
            (``time.monotonic()``); what it raises (a launcher's Ctrl-C) ends the wait. None: the
            socket's timeout ends it.
        deadline: when to stop waiting, with ``interrupt``.

    Returns:
        The bytes.

    Raises:
        TokenError: the connection closed first.
        OSError: reading failed (a timeout, say).

    Example::

        >>> a, b = socket.socketpair(); _ = a.send(b"abc"); read_exactly(b, 3)
        b'abc'
    """
    data = b""
    while len(data) < size:
        try:
            chunk = sock.recv(size - len(data))
        except socket.timeout:
            if interrupt is None or deadline is None or time.monotonic() >= deadline:
                raise
            interrupt()
            continue
        if not chunk:
            raise TokenError("the connection was closed")
        data += chunk
    return data


def greet(sock: socket.socket, token: str, kind: bytes = RELAY, interrupt: Optional[Callable[[], None]] = None,
          deadline: Optional[float] = None) -> None:
    """The client's side of the greeting, on a connected socket (see the module's docstring).

    Args:
        sock: connected to the rendezvous store's address; it should have a timeout.
        token: the job's token.
        kind: the kind of connection (``KINDS``).
        interrupt, deadline: as :func:`read_exactly`'s: a launcher waiting on a slow or silent
            listener still handles its Ctrl-C.

    Raises:
        ImpostorError: the server did not prove that it knows the token; nothing was sent to it
            but a nonce.
        TokenError: the server closed the connection, which it does when this token is wrong.
        OSError: the connection failed.

    Example::

        >>> greet(socket.create_connection((addr, port), timeout=10), os.environ[TOKEN_ENV])  # doctest: +SKIP
    """
    mine = os.urandom(NONCE_SIZE)
    sock.sendall(GREETING_PREFIX + kind + mine)
    try:
        theirs = read_exactly(sock, NONCE_SIZE, interrupt, deadline)
        server_proof = read_exactly(sock, PROOF_SIZE, interrupt, deadline)
    except TokenError as e:
        raise ImpostorError("the other side closed the connection instead of proving it knows the job's "
                            "token") from e
    nonces = mine + theirs
    if not proof_matches(token, SERVER, nonces, server_proof, kind):
        raise ImpostorError("the other side did not prove it knows the job's token")
    sock.sendall(proof(token, CLIENT, nonces, kind))
    try:
        answer = read_exactly(sock, len(ACCEPTED), interrupt, deadline)
    except TokenError:
        answer = b""
    if answer != ACCEPTED:
        raise TokenError("the rendezvous store refused this job token")


def token_line(token: str) -> bytes:
    """The first line the launcher writes to a remote rank's watcher (see ``TOKEN_ON_STDIN``).

    Args:
        token: the job's token.

    Returns:
        The line, newline included.

    Example::

        >>> token_line("ab12")
        b'token ab12\\n'
    """
    return b"token " + token.encode() + b"\n"


def send_line(stream, line: bytes) -> None:
    """Write ``line`` to a remote rank's watcher: its ssh client's stdin (the token's line, then
    the ``-x`` variables', see ``torchmn.run.remote.protocol``).

    Args:
        stream: the ssh client's stdin (``Popen.stdin``), or None.
        line: the line, newline included.

    Example::

        >>> send_line(rank.process.stdin, token_line(token))  # doctest: +SKIP
    """
    if stream is None:
        return
    try:
        stream.write(line)
        stream.flush()
    except (OSError, ValueError):
        pass  # the ssh client is gone: its exit says why


def send_token(stream, token: str) -> None:
    """Write ``token_line`` to a remote rank's watcher: its ssh client's stdin.

    Args:
        stream: the ssh client's stdin (``Popen.stdin``), or None.
        token: the job's token.

    Example::

        >>> send_token(rank.process.stdin, token)  # doctest: +SKIP
    """
    send_line(stream, token_line(token))


def read_line(fd: int, limit: int) -> Optional[bytes]:
    """Read one line from ``fd`` (the watcher's stdin), byte by byte up to the newline, so that
    nothing the launcher writes after it is taken away from the stdin reader.

    Args:
        fd: the file descriptor.
        limit: the longest line taken, in bytes.

    Returns:
        The line, newline included; None when the stream ended first or the line is longer.

    Example::

        >>> r, w = os.pipe(); _ = os.write(w, b"token ab12\\n"); read_line(r, 4096)
        b'token ab12\\n'
    """
    line = bytearray()
    while not line.endswith(b"\n"):
        byte = os.read(fd, 1)
        if not byte or len(line) >= limit:
            return None
        line += byte
    return bytes(line)


def read_token_line(fd: int) -> Optional[str]:
    """Read ``token_line`` from ``fd`` (the watcher's stdin), leaving what follows for the stdin
    reader (:func:`read_line`).

    Args:
        fd: the file descriptor.

    Returns:
        The token, or None when the stream ended first or the line is not a token line.

    Example::

        >>> r, w = os.pipe(); _ = os.write(w, token_line("ab12")); read_token_line(r)
        'ab12'
    """
    line = read_line(fd, 4096)
    if line is None or not line.startswith(b"token "):
        return None
    return line[len(b"token "):-1].decode(errors="replace") or None


def shared_token(env: Mapping[str, str], label: str) -> str:
    """The token every launcher of one job agrees on without talking (one per node, under Slurm or
    a platform): ``TORCHMN_JOB_TOKEN`` when it is set (srun passes an exported one to every task; a
    platform sets it from a secret), else an HMAC of ``label`` keyed with this user's key (see
    ``user_key``), the same on every node that shares the home directory.

    Args:
        env: the launcher's environment.
        label: what tells this job from others, the same on every node (``slurm step 42.0``).

    Returns:
        The token.

    Raises:
        TokenError: the given token is too short, or the key file can be neither read nor made.

    Example::

        >>> shared_token({TOKEN_ENV: "f" * 64}, "slurm step 42.0") == "f" * 64
        True
    """
    given = env.get(TOKEN_ENV, "")
    if given:
        if len(given) < MIN_TOKEN_CHARS:
            raise TokenError(f"{TOKEN_ENV} is set but has only {len(given)} characters; export at least "
                             f"{MIN_TOKEN_CHARS}, e.g. {TOKEN_ENV}=$(python -c 'import secrets; "
                             f"print(secrets.token_hex(32))')")
        return given
    key = user_key(env)
    return hmac.new(key, label.encode(), hashlib.sha256).hexdigest()


def key_path(env: Mapping[str, str]) -> str:
    """Where this user's key lives: ``$XDG_CONFIG_HOME/torchmn/job-key`` (``~/.config/...``).

    Args:
        env: the environment.

    Returns:
        The path.

    Example::

        >>> key_path({"XDG_CONFIG_HOME": "/home/me/.config"})
        '/home/me/.config/torchmn/job-key'
    """
    config = env.get("XDG_CONFIG_HOME") or os.path.join(env.get("HOME") or os.path.expanduser("~"), ".config")
    return os.path.join(config, "torchmn", "job-key")


def user_key(env: Mapping[str, str]) -> bytes:
    """This user's key, readable by this user alone (mode 0600), made once with 256 random bits.

    Several nodes that share the home directory may make it at the same moment: each writes a
    file of its own and links it into place (atomic, also over NFS), and every one then reads
    whichever won.

    Args:
        env: the environment (``HOME``, ``XDG_CONFIG_HOME``).

    Returns:
        The key.

    Raises:
        TokenError: the key can be neither read nor made.

    Example::

        >>> len(user_key(os.environ))  # doctest: +SKIP
        64
    """
    path = key_path(env)
    fix = (f"or export {TOKEN_ENV}=$(python -c 'import secrets; print(secrets.token_hex(32))') before srun "
           f"so that every task gets the same token")
    try:
        return _read_key(path, fix)
    except FileNotFoundError:
        pass
    except TokenError:
        raise  # an OSError too, but already the answer
    except OSError as e:
        raise TokenError(f"cannot read the torchmn key {path} ({e.strerror}); fix its permissions, {fix}") from e
    try:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        mine = f"{path}.{socket.gethostname()}.{os.getpid()}"
        fd = os.open(mine, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_hex(32).encode())
        try:
            os.link(mine, path)
        except FileExistsError:
            pass  # another node's won; read it
        finally:
            os.unlink(mine)
        return _read_key(path, fix)
    except TokenError:
        raise
    except OSError as e:
        raise TokenError(f"cannot make the torchmn key {path} ({e.strerror}); make its directory writable, {fix}") from e


def _read_key(path: str, fix: str) -> bytes:
    """The key in ``path``, read and checked through one open file: at least MIN_TOKEN_CHARS long,
    owned by this user and readable by no one else; else TokenError (a key anyone can read or guess
    would let anyone compute every step's token)."""
    with open(path, "rb") as f:
        st = os.fstat(f.fileno())
        key = f.read().strip()
    remedy = f"remove {path} (torchmn makes a new one) on every node that shares it, {fix}"
    if len(key) < MIN_TOKEN_CHARS:
        raise TokenError(f"the torchmn key {path} holds {len(key)} characters, fewer than {MIN_TOKEN_CHARS}, so "
                         f"the step tokens made from it could be guessed; {remedy}")
    if st.st_uid != os.getuid():
        raise TokenError(f"the torchmn key {path} belongs to user id {st.st_uid}, not to this user "
                         f"({os.getuid()}), who could then be impersonated by its owner; {remedy}")
    if st.st_mode & 0o077:
        raise TokenError(f"the torchmn key {path} can be read by others (mode {st.st_mode & 0o777:o}); run "
                         f"chmod 600 {path}, or {remedy}")
    return key


def token_from(env: Mapping[str, str]) -> Optional[str]:
    """The job's token in a rank's environment, if any.

    Args:
        env: the environment.

    Returns:
        The token, or None.

    Example::

        >>> token_from({TOKEN_ENV: "ab" * 32}) == "ab" * 32, token_from({})
        (True, None)
    """
    return env.get(TOKEN_ENV) or None
