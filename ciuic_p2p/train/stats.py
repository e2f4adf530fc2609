"""What ``MeshSync.stats`` returns: one replica's figures, as a typed dict whose every
key is documented here (docs/reference/api.md is generated from this)."""

from __future__ import annotations

from typing import Any, TypedDict


class SyncStats(TypedDict):
    peer: str
    step: int
    replicas: int
    sends: int
    merged_steps: int
    backoffs: int
    hook_traffic_bytes: int
    hook_held_bytes: int
    params_skipped: int
    chunks_sent: int
    bytes_published: int
    applied: int
    applied_by_origin: dict[str, int]
    applied_from: dict[str, int]
    held_by_state_by_origin: dict[str, int]
    refused_by_origin: dict[str, int]
    sent_by_origin: dict[str, int]
    params_mixed: int
    excused: int
    before_state: int
    start_step: int
    restored: dict[str, Any]
    snapshots_sent: int
    checkpoints_written: int
    checkpoint_path: str | None
    other_runs: int
    refused: dict[str, int]
    clipped: int
    weight_raised: int
    set_aside: dict[str, int]
    agreement_by_origin: dict[str, float]
    last_refusal: str
    staleness_p50: int
    staleness_p99: int
    staleness_bound: int
    send_interval: int
    density: float
    residual_norm: float
    residual_norm_max: float
    wait_s: float
    max_wait_s: float
    round_waits: int
    hook_s: float
    encoder_s: float
    udp_bytes_sent: int
    mode: str
    rounds_completed: int
    final_round: dict[str, Any] | None


STATS_DOC: dict[str, str] = {
    "peer": "this node's peer ID",
    "step": "this replica's step: the optimizer steps counted by `step()`, from its start",
    "replicas": "replicas of the run this one counts now, itself included",
    "sends": "updates sent (each in chunks, one or more per bucket: `chunks_sent`)",
    "merged_steps": "steps not sent in their own send (the encoder was still busy)",
    "backoffs": "times the daemon's backlog was over `train.backlog_high_sends` "
    "(the send interval doubled, the density halved, until it drained)",
    "hook_traffic_bytes": "bytes of model memory the hook read and wrote (counted on "
    "its code path)",
    "hook_held_bytes": "bytes of tensors the hook holds beside the model",
    "params_skipped": "consensus fragments not sent because the encoder was busy",
    "chunks_sent": "update chunks sent",
    "bytes_published": "bytes of chunks handed to the daemon",
    "applied": "peers' update chunks applied",
    "applied_by_origin": "update chunks applied per replica of the run now counted",
    "applied_from": "update chunks applied per origin, also of replicas that left",
    "held_by_state_by_origin": "chunks per origin that the restored state held already",
    "refused_by_origin": "update chunks refused per origin",
    "sent_by_origin": "chunks each origin said it sent in all (its DONE)",
    "params_mixed": "peers' consensus fragments mixed in",
    "excused": "times a replica behind the staleness bound was excused (`train.stall_grace_s`)",
    "before_state": "peers' chunks dropped because the restored state holds them",
    "start_step": "the step this replica began at (0, or its restored state's)",
    "restored": "where the state came from at attach: `source` (fresh, mesh, checkpoint), "
    "`step`, `seconds` and the transfer's figures",
    "snapshots_sent": "state snapshots handed to the daemon for joiners",
    "checkpoints_written": "checkpoints written",
    "checkpoint_path": "where this replica's checkpoint goes (the one before it beside it, "
    "as `.prev`); None when it writes none",
    "other_runs": "JOIN, GONE and DONE messages of other runs on the mesh, ignored",
    "refused": "refused payloads by reason (`layout`, `range`, `norm`, `malformed`, "
    "`pace`, `set_aside`, ...)",
    "clipped": "peer update chunks taken at less than their norm or weight (one origin's "
    "influence bounded: docs/concepts/security.md)",
    "weight_raised": "peer update chunks that claimed a smaller run than this replica "
    "saw, weighted by what it saw",
    "set_aside": "origins set aside after repeated refusals, and until which step of this replica",
    "agreement_by_origin": "each origin's running agreement with this replica's own "
    "direction (-1 to 1; below 0 it loses weight where `train.influence_disagreement` is set)",
    "last_refusal": "the last refusal's message",
    "staleness_p50": "median steps between a peer's update and this replica's step when "
    "it was applied",
    "staleness_p99": "99th percentile of the same: at `staleness_bound` the rule held "
    "this replica back (or excused a laggard); a run that sits there is as fast as its "
    "slowest replica",
    "staleness_bound": "`train.staleness_bound_steps`",
    "send_interval": "steps per send now (grows under back-off)",
    "density": "fraction of entries sent now (shrinks under back-off)",
    "residual_norm": "the norm of what is not sent yet (error feedback)",
    "residual_norm_max": "its largest value so far",
    "wait_s": "seconds `step()` waited for a replica behind the staleness bound, or "
    "(outer mode) for the encoder at a round's end",
    "max_wait_s": "the longest single such wait",
    "round_waits": "outer mode: round ends that waited for the encoder (a round's send is "
    "never merged into the next)",
    "hook_s": "seconds spent in `step()` in all",
    "encoder_s": "seconds the encoder thread was busy",
    "udp_bytes_sent": "UDP bytes this node's daemon sent (all traffic)",
    "mode": "`train.mode`: `step` or `outer`",
    "rounds_completed": "outer mode: rounds every live replica has sent, whose outer step "
    "is in this replica (0 in step mode)",
    "final_round": "after `finish()`, its last round (`train.finish_average`): `members` "
    "(copies averaged, this one's included), `complete`, `missing` (members whose whole "
    "copy did not come), `refused` by reason, `distance_max` (how far apart the replicas "
    "were before it, relative), `counted_otherwise` (members that averaged another "
    "number of copies) and `seconds`; None before `finish()` or when no round ran",
}
