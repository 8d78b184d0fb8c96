"""Online W&B only when its server answers: otherwise the run logs offline and says how to upload it.

Left alone, ``wandb.init(mode="online")`` against a server it cannot reach retries for
``init_timeout`` (90 s) plus a 10 s grace and then raises ``CommError``: nothing is trained. Asking the
server once, with a short deadline, before the run starts turns that into an offline run (every
metric kept on disk) and one warning line with the ``wandb sync`` command that uploads it later.
"""

from __future__ import annotations

import os
import shlex
import ssl
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

CLOUD_URL = "https://api.wandb.ai"  # only if wandb's settings cannot be read (wandb 0.31's own default fronts it)


def server_url() -> str:
    """The W&B server ``wandb.init`` talks to: ``$WANDB_BASE_URL``, else the ``base_url`` of the wandb
    settings files (``wandb login --host`` writes it), else W&B's cloud."""
    if url := os.environ.get("WANDB_BASE_URL"):
        return url.rstrip("/")
    try:  # wandb's settings loaded by its public setup, as wandb.init loads them; mode "disabled" starts
        import wandb  # no service (one started now would miss WANDB_ERROR_REPORTING), teardown forgets them

        url = wandb.setup(wandb.Settings(mode="disabled")).settings.base_url
        wandb.teardown()
        return url
    except Exception:
        return CLOUD_URL


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A redirect is an answer: report it as such rather than follow it to another host."""

    def redirect_request(self, *args, **kwargs):
        return None


def unreachable_reason(url: str, timeout_s: float) -> str | None:
    """None when ``url`` answers an HTTP request within ``timeout_s`` seconds, else why not.

    Any answer below 500 (a 404 or 401 included) means the server is there; a 5xx is a gateway whose
    W&B is down. Proxies are taken from the environment, as wandb does. Certificates are not checked:
    nothing is sent but a bare GET, and a CA bundle that differs from wandb's must not turn a
    reachable server into an offline run. The deadline is for the whole check, name lookup included.
    """
    tls = ssl.create_default_context()
    tls.check_hostname, tls.verify_mode = False, ssl.CERT_NONE
    opener = urllib.request.build_opener(_NoRedirect, urllib.request.HTTPSHandler(context=tls))
    outcome: list[str | None] = []

    def probe() -> None:
        try:
            opener.open(url, timeout=timeout_s).close()
            outcome.append(None)
        except urllib.error.HTTPError as error:
            outcome.append(None if error.code < 500 else f"HTTP {error.code}")
        except Exception as error:
            cause = error.reason if isinstance(error, urllib.error.URLError) else error
            outcome.append(f"{type(cause).__name__}: {cause}" if isinstance(cause, BaseException) else str(cause))

    thread = threading.Thread(target=probe, name="wandb-reach", daemon=True)
    thread.start()
    thread.join(timeout_s)  # a lookup that hangs past the deadline is left behind (daemon thread)
    return outcome[0] if outcome else "no answer"


def sync_command(run_dir: Path | str) -> str:
    """The shell command that uploads the offline W&B run(s) written under ``run_dir``."""
    return f"wandb sync {shlex.quote(str(Path(run_dir).absolute()))}/wandb/offline-run-*"


def effective_mode(mode: str, timeout_s: float, run_dir: Path | str) -> str:
    """``mode``, unless it is ``"online"`` and the W&B server does not answer within ``timeout_s``:
    then ``"offline"``, after one warning line on stderr naming the server, the reason and the
    ``wandb sync`` command that uploads the run once the server is back."""
    if mode != "online":
        return mode
    url = server_url()
    reason = unreachable_reason(url, timeout_s)
    if reason is None:
        return mode
    reason = " ".join(reason.split())  # one line, whatever the error's message
    # wandb's own analytics would still call the server as the process exits (up to 10 s more)
    os.environ["WANDB_ERROR_REPORTING"] = "false"
    print(
        f"warning: W&B server {url} unreachable ({reason}) within {timeout_s:g} s: logging offline;"
        f" upload later with: {sync_command(run_dir)}",
        file=sys.stderr,
        flush=True,
    )
    return "offline"
