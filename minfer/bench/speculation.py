"""bench.py's speculative-decoding figures: the proposals a run verified and accepted, from the engine's
counters (offline: scheduler.stats(); online: the server's /metrics), as vLLM reports them."""

from __future__ import annotations

from .metrics import _row
from .online import Endpoint

COUNTERS = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")


def counters_of_stats(stats: dict) -> dict | None:
    """The counters in an OnlineScheduler.stats() snapshot; None when the engine does not speculate."""
    return {k: stats[k] for k in COUNTERS} if COUNTERS[0] in stats else None


def counters_of_server(endpoint: Endpoint) -> dict | None:
    """The counters a minfer server's /metrics shows (minfer_<counter>_total); None if it shows none."""
    conn = endpoint.connect(5.0)
    try:
        conn.request("GET", endpoint.prefix + "/metrics")
        resp = conn.getresponse()
        text = resp.read().decode("utf-8", "replace") if resp.status == 200 else ""
    except OSError:
        return None
    finally:
        conn.close()
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name.startswith("minfer_spec_decode_num_") and name.endswith("_total"):
            values[name.removeprefix("minfer_").removesuffix("_total")] = float(value)
    return {k: int(values[k]) for k in COUNTERS} if all(k in values for k in COUNTERS) else None


def spec_summary(before: dict | None, after: dict | None) -> dict:
    """What a run's verifications did: their count, proposals, accepted ones, the acceptance rate and
    the mean accepted length (tokens a verification emits: accepted proposals + the target's own)."""
    if before is None or after is None:
        return {}
    drafts, proposed, accepted = (after[k] - before[k] for k in COUNTERS)
    return {
        "spec_num_drafts": drafts,
        "spec_num_draft_tokens": proposed,
        "spec_num_accepted_tokens": accepted,
        "spec_acceptance_rate": accepted / proposed if proposed else None,
        "spec_mean_accepted_length": 1 + accepted / drafts if drafts else None,
    }


def format_spec(summary: dict) -> str:
    """The summary's speculative-decoding lines ("" for a run without speculation)."""
    if "spec_num_drafts" not in summary:
        return ""
    return "\n".join(
        [
            f"{'Speculative decoding':-^50}",
            _row("Verifications:", summary["spec_num_drafts"]),
            _row("Proposed tokens:", summary["spec_num_draft_tokens"]),
            _row("Accepted tokens:", summary["spec_num_accepted_tokens"]),
            _row("Acceptance rate:", summary["spec_acceptance_rate"]),
            _row("Mean accepted length:", summary["spec_mean_accepted_length"]),
        ]
    )
