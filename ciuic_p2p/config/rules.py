"""The rules a :class:`~ciuic_p2p.config.Config` must satisfy beyond its types.

Each failed rule raises :class:`ConfigError` naming the key and why.
"""

from __future__ import annotations

from typing import Protocol

from ciuic_p2p.addresses import parse_address
from ciuic_p2p.config.sections import (
    MAX_CHUNK_PAYLOAD_BYTES,
    AuditSection,
    CodecSection,
    LogSection,
    MeshSection,
    NodeSection,
    StoreSection,
    TrainSection,
    TransportSection,
    WebSection,
)
from ciuic_p2p.core.link.lanes import MAX_LANES
from ciuic_p2p.errors import ConfigError


class Sections(Protocol):
    """What :func:`validate` reads of a config (``ciuic_p2p.config.Config``): its
    sections, named here rather than imported, so that the config and its rules do
    not import each other."""

    @property
    def codec(self) -> CodecSection: ...
    @property
    def node(self) -> NodeSection: ...
    @property
    def transport(self) -> TransportSection: ...
    @property
    def mesh(self) -> MeshSection: ...
    @property
    def train(self) -> TrainSection: ...
    @property
    def store(self) -> StoreSection: ...
    @property
    def log(self) -> LogSection: ...
    @property
    def web(self) -> WebSection: ...
    @property
    def audit(self) -> AuditSection: ...


def validate(cfg: Sections) -> None:
    c = cfg.codec
    checks: list[tuple[bool, str, str]] = [
        (0.0 < c.density <= 1.0, "codec.density", "must be in (0, 1]"),
        (1 <= c.block_size <= 4096, "codec.block_size", "must be in [1, 4096]"),
        (c.exact_below_numel >= 0, "codec.exact_below_numel", "must be >= 0"),
        (c.dense_below_numel >= 0, "codec.dense_below_numel", "must be >= 0"),
        (c.sample_size >= 1024, "codec.sample_size", "must be >= 1024"),
        (
            4096 <= c.chunk_payload_bytes <= MAX_CHUNK_PAYLOAD_BYTES,
            "codec.chunk_payload_bytes",
            f"must be in [4096, {MAX_CHUNK_PAYLOAD_BYTES}]",
        ),
        (c.residual_max_ratio >= 0.0, "codec.residual_max_ratio", "must be >= 0"),
        (0 <= cfg.node.listen_port <= 65535, "node.listen_port", "must be in [0, 65535]"),
        (bool(cfg.node.name.strip()), "node.name", "must not be empty"),
        (
            cfg.node.name.isascii() and cfg.node.name.isprintable() and len(cfg.node.name) <= 64,
            "node.name",
            "must be printable ASCII of at most 64 characters (members see it)",
        ),
        (cfg.transport.auth_timeout_s > 0, "transport.auth_timeout_s", "must be > 0"),
        (cfg.transport.idle_timeout_s > 0, "transport.idle_timeout_s", "must be > 0"),
        (cfg.transport.ping_interval_s > 0, "transport.ping_interval_s", "must be > 0"),
        (cfg.transport.stall_timeout_s > 0, "transport.stall_timeout_s", "must be > 0"),
        (cfg.transport.reconnect_base_s > 0, "transport.reconnect_base_s", "must be > 0"),
        (
            cfg.transport.reconnect_max_s >= cfg.transport.reconnect_base_s,
            "transport.reconnect_max_s",
            "must be >= reconnect_base_s",
        ),
        (
            cfg.transport.receive_window_bytes >= 2 * MAX_CHUNK_PAYLOAD_BYTES + 4096,
            "transport.receive_window_bytes",
            "must hold at least two largest chunks (>= 2101248)",
        ),
        (
            cfg.transport.receive_window_max_bytes >= cfg.transport.receive_window_bytes,
            "transport.receive_window_max_bytes",
            "must be >= receive_window_bytes",
        ),
        (
            0 <= cfg.transport.path_rate_bps <= 1e12,
            "transport.path_rate_bps",
            "must be in [0, 1e12]",
        ),
        (
            cfg.transport.quic_backend == "aioquic" or cfg.transport.congestion_control == "cubic",
            "transport.congestion_control",
            "qh3 always runs CUBIC; only aioquic offers another",
        ),
        (
            1200 <= cfg.transport.max_datagram_size <= 65527,
            "transport.max_datagram_size",
            "must be in [1200, 65527]",
        ),
        (
            cfg.transport.socket_buffer_bytes >= 65536,
            "transport.socket_buffer_bytes",
            "must be >= 65536",
        ),
        (
            cfg.transport.max_pending_connections >= 1,
            "transport.max_pending_connections",
            "must be >= 1",
        ),
        (
            1 <= cfg.transport.max_pending_per_prefix <= cfg.transport.max_pending_connections,
            "transport.max_pending_per_prefix",
            "must be in [1, max_pending_connections]",
        ),
        (
            cfg.transport.retry_above_pending >= 0,
            "transport.retry_above_pending",
            "must be >= 0 (0: every new source returns a Retry token first)",
        ),
        (cfg.transport.handshakes_per_s >= 1, "transport.handshakes_per_s", "must be >= 1"),
        (
            cfg.transport.max_control_send_bytes >= 1 << 20,
            "transport.max_control_send_bytes",
            "must be >= 1048576",
        ),
        (
            cfg.transport.max_credit_bytes >= cfg.transport.receive_window_bytes,
            "transport.max_credit_bytes",
            "must be >= receive_window_bytes",
        ),
        (
            1 <= cfg.transport.lanes <= MAX_LANES,
            "transport.lanes",
            f"must be in [1, {MAX_LANES}]",
        ),
        (
            cfg.transport.lane_base_port == 0
            or 1024 <= cfg.transport.lane_base_port <= 65536 - cfg.transport.lanes,
            "transport.lane_base_port",
            "must be 0 (any free ports) or in [1024, 65536 - lanes]",
        ),
    ]
    m = cfg.mesh
    positive = [
        "probe_interval_s", "probe_timeout_min_s", "probe_timeout_initial_s",
        "suspicion_mult", "gossip_interval_s", "sync_interval_s", "reconnect_interval_s",
        "join_retry_s", "leave_propagate_s", "link_sync_interval_s", "heads_interval_s",
        "repair_after_s", "chunk_retain_s", "default_rate_bps",
    ]  # fmt: skip
    checks += [(getattr(m, k) > 0, f"mesh.{k}", "must be > 0") for k in positive]
    checks += [
        (m.probe_timeout_max_s >= m.probe_timeout_min_s, "mesh.probe_timeout_max_s",
         "must be >= probe_timeout_min_s"),
        (m.suspicion_max_mult >= 1.0, "mesh.suspicion_max_mult", "must be >= 1"),
        (m.indirect_probes >= 0, "mesh.indirect_probes", "must be >= 0"),
        (m.gossip_fanout >= 1, "mesh.gossip_fanout", "must be >= 1"),
        (m.heads_fanout >= 1, "mesh.heads_fanout", "must be >= 1"),
        (0 <= m.link_rate_change_ratio <= 10, "mesh.link_rate_change_ratio",
         "must be in [0, 10]"),
        (m.heads_idle_interval_s >= m.heads_interval_s, "mesh.heads_idle_interval_s",
         "must be >= heads_interval_s"),
        (m.repair_after_s <= m.repair_after_max_s <= m.chunk_retain_s,
         "mesh.repair_after_max_s", "must be in [repair_after_s, chunk_retain_s]"),
        (m.own_chunk_retain_s >= m.chunk_retain_s, "mesh.own_chunk_retain_s",
         "must be >= chunk_retain_s"),
        (m.retransmit_mult >= 1, "mesh.retransmit_mult", "must be >= 1"),
        (m.awareness_max >= 1, "mesh.awareness_max", "must be >= 1"),
        (m.tree_max_fanout >= 1, "mesh.tree_max_fanout", "must be >= 1"),
        (0 <= m.route_hysteresis < 1, "mesh.route_hysteresis", "must be in [0, 1)"),
        (0 <= m.tree_relay_margin < 1, "mesh.tree_relay_margin", "must be in [0, 1)"),
        (256 <= m.piggyback_bytes <= 16384, "mesh.piggyback_bytes", "must be in [256, 16384]"),
        (1 <= m.link_state_max_peers <= 1024, "mesh.link_state_max_peers", "must be in [1, 1024]"),
        (m.suspicion_confirmations >= 0, "mesh.suspicion_confirmations", "must be >= 0"),
        (2 <= m.max_members <= 1 << 20, "mesh.max_members", "must be in [2, 1048576]"),
        (m.address_change_min_s >= 0, "mesh.address_change_min_s", "must be >= 0"),
        (0 <= m.rejoin_min_s <= 60, "mesh.rejoin_min_s", "must be in [0, 60]"),
        (0 <= m.link_publish_min_s <= min(m.link_refresh_s, 60.0), "mesh.link_publish_min_s",
         "must be in [0, min(link_refresh_s, 60)]"),
        (0 <= m.strategy_hysteresis < 1, "mesh.strategy_hysteresis", "must be in [0, 1)"),
        (0 <= m.rate_probe_bytes <= 4 * 256 * 1024, "mesh.rate_probe_bytes",
         "must be in [0, 1048576] (four frames of at most 256 KiB)"),
        (0 <= m.rate_probe_below < 1, "mesh.rate_probe_below", "must be in [0, 1)"),
        (m.rate_probe_interval_s >= 1, "mesh.rate_probe_interval_s", "must be >= 1"),
        (m.pace_gain == 0 or 1 <= m.pace_gain <= 4, "mesh.pace_gain", "must be 0 or 1 to 4"),
        (0 <= m.cluster_rtt_s <= 10, "mesh.cluster_rtt_s", "must be in [0, 10]"),
        (m.node_uplink_bps >= 0, "mesh.node_uplink_bps", "must be >= 0 (inf: independent links)"),
    ]  # fmt: skip
    t = cfg.train
    checks += [
        (t.staleness_bound_steps >= 1, "train.staleness_bound_steps", "must be >= 1"),
        (t.send_interval_steps >= 1, "train.send_interval_steps", "must be >= 1"),
        (t.max_send_interval_steps >= t.send_interval_steps, "train.max_send_interval_steps",
         "must be >= send_interval_steps"),
        (t.max_send_interval_steps < t.staleness_bound_steps, "train.max_send_interval_steps",
         "must be below staleness_bound_steps (or peers would always wait)"),
        (0.0 < t.min_density <= c.density, "train.min_density", "must be in (0, codec.density]"),
        (t.backlog_low_bytes < t.backlog_high_bytes, "train.backlog_low_bytes",
         "must be below backlog_high_bytes"),
        (t.consensus_interval_steps >= 0, "train.consensus_interval_steps", "must be >= 0"),
        (1 <= t.consensus_fragments <= 4096, "train.consensus_fragments", "must be in [1, 4096]"),
        (t.backlog_low_sends < t.backlog_high_sends, "train.backlog_low_sends",
         "must be below backlog_high_sends"),
        (t.backlog_low_sends >= 0.0, "train.backlog_low_sends", "must be >= 0"),
        (0.0 <= t.consensus_mix <= 1.0, "train.consensus_mix", "must be in [0, 1]"),
        (t.update_norm_max_ratio > 1.0, "train.update_norm_max_ratio", "must be > 1"),
        (
            0.0 < t.params_distance_max_ratio <= 10.0,
            "train.params_distance_max_ratio",
            "must be in (0, 10]",
        ),
        (t.norm_warmup_chunks >= 1, "train.norm_warmup_chunks", "must be >= 1"),
        (1.0 <= t.influence_clip_ratio <= 100.0, "train.influence_clip_ratio",
         "must be in [1, 100]"),
        (1.0 <= t.influence_clip_ratio_rounds <= 100.0, "train.influence_clip_ratio_rounds",
         "must be in [1, 100]"),
        (0.0 <= t.influence_disagreement <= 1.0, "train.influence_disagreement",
         "must be in [0, 1]"),
        (1 <= t.influence_window_sends <= 10_000, "train.influence_window_sends",
         "must be in [1, 10000]"),
        (0 <= t.set_aside_refusals <= 1_000_000, "train.set_aside_refusals",
         "must be in [0, 1000000]"),
        (1 <= t.set_aside_steps <= 100_000_000, "train.set_aside_steps",
         "must be in [1, 100000000]"),
        (t.finish_timeout_s > 0, "train.finish_timeout_s", "must be > 0"),
        (0.0 < t.finish_average_distance_max_ratio <= 10.0,
         "train.finish_average_distance_max_ratio", "must be in (0, 10]"),
        (t.stall_grace_s > 0, "train.stall_grace_s", "must be > 0"),
        (1 <= t.inner_steps <= 10_000, "train.inner_steps", "must be in [1, 10000]"),
        (t.mode != "outer" or t.staleness_bound_steps >= 2 * t.inner_steps,
         "train.staleness_bound_steps",
         "must be >= 2 x train.inner_steps in outer mode (a round travels while the next "
         "computes)"),
        (0.0 < t.outer_lr <= 10.0, "train.outer_lr", "must be in (0, 10]"),
        (0.0 <= t.outer_momentum < 1.0, "train.outer_momentum", "must be in [0, 1)"),
    ]  # fmt: skip
    st = cfg.store
    checks += [
        (4096 <= st.piece_bytes <= 1 << 20, "store.piece_bytes", "must be in [4096, 1048576]"),
        (1 <= st.window_pieces <= 256, "store.window_pieces", "must be in [1, 256]"),
        (
            st.max_inflight_bytes >= st.piece_bytes,
            "store.max_inflight_bytes",
            "must be >= store.piece_bytes",
        ),
        (st.max_donors >= 1, "store.max_donors", "must be >= 1"),
        (st.upload_slots >= 1, "store.upload_slots", "must be >= 1"),
        (st.replicas >= 0, "store.replicas", "must be >= 0"),
        (st.max_corrupt_per_donor >= 1, "store.max_corrupt_per_donor", "must be >= 1"),
        (st.state_version_slack_steps >= 0, "store.state_version_slack_steps", "must be >= 0"),
        (
            0.0 < st.state_agreement_tolerance <= 2.0,
            "store.state_agreement_tolerance",
            "must be in (0, 2]",
        ),
        (1 <= st.state_vouchers <= 8, "store.state_vouchers", "must be in 1..8"),
        (
            1 <= st.max_version_jump < 1 << 47,
            "store.max_version_jump",
            "must be between 1 and 2^47 - 1",
        ),
        (st.checkpoint_interval_s >= 0, "store.checkpoint_interval_s", "must be >= 0"),
        (
            0 <= st.stop_checkpoint_wait_s <= 300,
            "store.stop_checkpoint_wait_s",
            "must be in 0..300 (the unit's TimeoutStopSec must cover it)",
        ),
        (st.upload_rate_bps >= 0, "store.upload_rate_bps", "must be >= 0"),
        (
            st.max_object_bytes >= st.piece_bytes,
            "store.max_object_bytes",
            "must be >= store.piece_bytes",
        ),
        (st.max_held_bytes >= 0, "store.max_held_bytes", "must be >= 0"),
        (
            st.max_upload_queue_bytes >= st.piece_bytes,
            "store.max_upload_queue_bytes",
            "must be >= store.piece_bytes",
        ),
    ]  # fmt: skip
    checks += [
        (getattr(st, k) > 0, f"store.{k}", "must be > 0")
        for k in ("upload_idle_s", "query_timeout_s", "piece_timeout_s", "retry_s",
                  "fetch_timeout_s", "unknown_rtt_s")
    ]  # fmt: skip
    n = cfg.node
    checks += [
        (n.first_join_timeout_s > 0, "node.first_join_timeout_s", "must be > 0"),
        (n.join_retry_s > 0, "node.join_retry_s", "must be > 0"),
        (0 < n.stop_timeout_s <= 30, "node.stop_timeout_s", "must be in (0, 30]"),
        (0 <= cfg.web.port <= 65535, "web.port", "must be in [0, 65535]"),
        (cfg.web.refresh_s > 0, "web.refresh_s", "must be > 0"),
        (cfg.web.header_timeout_s > 0, "web.header_timeout_s", "must be > 0"),
        (cfg.web.max_connections >= 1, "web.max_connections", "must be >= 1"),
        (cfg.log.rate_limit_burst >= 1, "log.rate_limit_burst", "must be >= 1"),
        (cfg.log.rate_limit_window_s > 0, "log.rate_limit_window_s", "must be > 0"),
        (cfg.audit.interval_s > 0, "audit.interval_s", "must be > 0"),
        (cfg.audit.rotate_bytes >= 4096, "audit.rotate_bytes", "must be >= 4096"),
        (
            cfg.audit.max_dir_bytes == 0 or cfg.audit.max_dir_bytes >= 2 * cfg.audit.rotate_bytes,
            "audit.max_dir_bytes",
            "must be 0 (unbounded) or at least two files (2 x rotate_bytes)",
        ),
    ]
    for seed in n.join:
        try:
            parse_address(seed)
        except ValueError as exc:
            checks.append((False, "node.join", str(exc)))
    for ok, key, why in checks:
        if not ok:
            raise ConfigError(f"{key}: {why}")
