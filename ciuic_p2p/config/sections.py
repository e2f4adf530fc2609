"""The sections of :class:`~ciuic_p2p.config.Config`: every setting a node has, its
default and what it does (``ciuic-node config example`` prints these docstrings).
Import them from ``ciuic_p2p.config``."""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from typing import Literal

MAX_CHUNK_PAYLOAD_BYTES = 1 << 20
"""Hard limit of the wire format on one chunk's payload (core.codec.chunk)."""

ValueMode = Literal["int8", "int4", "int2", "fp16"]
DenseDtype = Literal["fp32", "fp16", "bf16"]
Selection = Literal["approx", "exact"]
LogFormat = Literal["auto", "json", "console"]
LogLevel = Literal["debug", "info", "warning", "error"]
QuicBackendName = Literal["aioquic", "qh3"]
CongestionControl = Literal["cubic", "reno"]
TrainMode = Literal["step", "outer"]
OuterOptimizer = Literal["average", "nesterov"]
FinishAverage = Literal["off", "fp16", "bf16", "fp32"]


def host_name() -> str:
    """This host's name, kept to what a node name may be (printable ASCII, at most 64
    characters: config.rules); ``node`` on a host without one."""
    name = "".join(c for c in socket.gethostname() if c.isascii() and c.isprintable())
    return name.strip()[:64].strip() or "node"


@dataclass(frozen=True, slots=True)
class NodeSection:
    """Who this node is and where it listens."""

    name: str = field(default_factory=host_name)
    """Human-readable node name, unique within the mesh; gossiped to the members, who
    show it beside the peer ID (status, peers, routes, the page, metrics). Default:
    this host's name (two nodes on one host share it; their peer IDs tell them apart)."""
    region: str = ""
    """Free-form region label (e.g. ``aws:eu-central-1``); routing may use it as a hint."""
    listen_host: str = "127.0.0.1"
    """Address the QUIC endpoint binds to. Loopback by default: opening up is explicit."""
    listen_port: int = 7946
    """UDP port of the QUIC endpoint."""
    advertise_host: str = ""
    """Address other members dial to reach this node (``--advertise``); default: the
    listen host. Required when listening on a wildcard (0.0.0.0 or ::)."""
    state_dir: str = "/var/lib/ciuic"
    """Directory for the key, checkpoints and the audit log (systemd StateDirectory)."""
    join: tuple[str, ...] = ()
    """Members (``HOST:PORT``) to join the mesh through at start, tried in turn
    (``--join`` adds one in front)."""
    first_join_timeout_s: float = 30.0
    """How long the first join attempt may take before the daemon reports ready
    anyway and keeps trying in the background (a node whose seeds are down at boot is
    not restarted in a loop by systemd)."""
    join_retry_s: float = 10.0
    """Pause between background join attempts."""
    stop_timeout_s: float = 4.0
    """SIGTERM/Ctrl+C: after the attached trainer's checkpoint
    (``store.stop_checkpoint_wait_s``), the announced leave and the audit log's flush
    get this long before the daemon exits anyway (out within 15 s; the unit's
    TimeoutStopSec is 20 s)."""
    runtime_dir: str = ""
    """Directory for the control and trainer sockets (systemd RuntimeDirectory);
    default: ``state_dir``."""


@dataclass(frozen=True, slots=True)
class CodecSection:
    """How updates are compressed before they leave the node (see core.codec)."""

    density: float = 0.01
    """Fraction of a sparse bucket's entries sent each step (top-k by magnitude).
    At 1% the INT8 payload costs about 16.3 bits per sent value, about 190x less than
    dense fp32."""
    value_mode: ValueMode = "int8"
    """Encoding of the selected values: INT8, INT4 or INT2 with one fp32 scale per
    block (the 4- and 2-bit codes packed; core.codec.quant), or fp16. Fewer bits send
    less and leave more in the error-feedback residual: at 1% the positions cost
    about 8 bits per value whatever the width (bench/codec.py)."""
    block_size: int = 64
    """Selected values per INT8 scale. 64 costs 0.5 bit per value for the fp32 scale
    and keeps a block's largest value, which sets the step size, from flattening the
    rest of a heavy-tailed block; see bench/codec.py's block-size rows."""
    selection: Selection = "approx"
    """``approx``: estimate the k-th magnitude from a random sample, select by mask and
    trim to k (fast); ``exact``: ``torch.topk`` (slow on large tensors, for tests)."""
    exact_below_numel: int = 65_536
    """Buckets smaller than this use exact selection: sampling buys nothing there."""
    dense_below_numel: int = 16_384
    """Tensors smaller than this (biases, norms) go to a dense bucket: the index costs
    more than it saves."""
    dense_dtype: DenseDtype = "fp16"
    """Wire type of dense buckets."""
    sample_size: int = 32_768
    """Random entries inspected to estimate the threshold of approximate selection."""
    chunk_payload_bytes: int = MAX_CHUNK_PAYLOAD_BYTES
    """Upper bound on one chunk's payload; chunks travel, relay and get lost
    independently. At most the wire limit of 1 MiB."""
    residual_max_ratio: float = 0.0
    """When > 0, the error-feedback residual's L2 norm is kept at most this many times
    the running mean norm of recent updates (scaled down when it grows past). 0
    disables the bound: the residual is then exactly what has not been sent."""


@dataclass(frozen=True, slots=True)
class TransportSection:
    """The QUIC transport (see ciuic_p2p.transport)."""

    auth_timeout_s: float = 2.0
    """A connection that has not proven its identity within this time is closed."""
    idle_timeout_s: float = 30.0
    """QUIC idle timeout: a link with no packets for this long is closed."""
    ping_interval_s: float = 5.0
    """Application-level ping on every link: keep-alive and RTT samples."""
    stall_timeout_s: float = 10.0
    """A peer that grants no credit (does not read) for this long while we have bulk
    data for it is dropped."""
    receive_window_bytes: int = 4 * 1024 * 1024
    """Bulk bytes a peer may send us before our application consumed them: the
    receive quota per peer, and the bound on what a sender buffers for one peer."""
    receive_window_max_bytes: int = 64 * 1024 * 1024
    """The most a link's receive window grows to (see ``path_rate_bps``): the bound on
    what one peer may have queued here unread."""
    path_rate_bps: float = 1e9
    """The rate one link's window should carry: it grows, as RTT samples come, to twice
    the smallest RTT times this (a 1 Gbit/s inter-region path at 330 ms holds 41 MB in
    flight); 0 keeps ``receive_window_bytes``."""
    max_datagram_size: int = 1452
    """Largest UDP payload. 1452 fits a 1500-byte path MTU over IPv6 (1500 - 40 - 8)
    and IPv4; aioquic's default of 1200 costs about 20% of goodput."""
    udp_gso: bool = True
    """Send each transmit's run of equal-sized datagrams to one peer in one system call
    with UDP generic segmentation offload (Linux 4.18 and later; transport.gso); one
    ``sendto`` per datagram cost 11-16% of a daemon's CPU moving bulk data. Turned
    off by itself for good when the kernel refuses it, and never used under the WAN
    emulator, which must see every datagram."""
    socket_buffer_bytes: int = 4 * 1024 * 1024
    """Receive and send buffer asked of the kernel for the UDP socket. Linux's default
    (about 208 KiB, some 90 full datagrams) overflows when several peers send at once
    while the loop is busy, and each overflow reads as a congestion loss. The kernel
    grants at most ``net.core.rmem_max`` / ``wmem_max``; the daemon logs what it got
    when that is less (raise those sysctls, as for quic-go)."""
    quic_backend: QuicBackendName = "qh3"
    """The QUIC library: ``qh3`` (2.x: aioquic's API over a connection core, packet
    protection and TLS in Rust, about 0.4x aioquic's CPU per MB and twice qh3 1.x's
    goodput on one core, bench/transport.py; 1.9 up to 2 works too) or ``aioquic``
    (pure Python). Both are installed and interoperate, so a mesh may mix them; every
    transport test runs on both. qh3 always runs CUBIC (with HyStart++ in 2.x). A node
    on qh3 2.x answers a peer whose first datagram is padded after its Initial packet
    (aioquic, qh3 1.x) with a Retry: one round trip more at that peer's first contact."""
    congestion_control: CongestionControl = "cubic"
    """QUIC congestion control (aioquic's). After a loss CUBIC (RFC 9438) regrows its
    window with time rather than per round trip, so a long path recovers in seconds
    where Reno (aioquic's default) adds one datagram per round trip: at 0.05% loss on
    a 330 ms path one link carries about 1.5 times as much (bench/wanlink.py)."""
    connect_timeout_s: float = 5.0
    """Handshake plus authentication time allowed for an outgoing connection."""
    reconnect_base_s: float = 0.5
    """First reconnect delay bound; doubles per failed attempt (full jitter)."""
    reconnect_max_s: float = 30.0
    """Cap on the reconnect delay bound."""
    max_pending_connections: int = 256
    """Connections not yet authenticated that this node holds at once (each about
    25 KB until ``auth_timeout_s``); past it, new ones are dropped (transport.gate)."""
    max_pending_per_prefix: int = 32
    """The same, per source network (/24 for IPv4, /56 for IPv6)."""
    retry_above_pending: int = 16
    """With this many connections pending, a new source must first return a QUIC Retry
    token (one round trip) before it costs any state: forged source addresses cannot."""
    handshakes_per_s: float = 200.0
    """New connections admitted per second at most (a TLS handshake is about 1.5 ms of
    CPU): strangers cannot take the loop from the members."""
    max_control_send_bytes: int = 4 * 1024 * 1024
    """Control-stream bytes sent to a peer and not acknowledged, at most; a peer that
    lets more pile up (it withholds QUIC's window, or never acknowledges) is dropped."""
    max_credit_bytes: int = 1 << 32
    """A peer that grants more bulk credit than this in all, outstanding, is dropped:
    no honest receiver grants more than a few windows ahead."""
    lanes: int = 1
    """Paths for this node's chunks (transport.laned): 1, its own link; K of 2 to 16 adds
    K - 1 lane processes, each with its own UDP socket and QUIC on a core of its own,
    paired with a peer's lanes when it runs as many (else its chunks keep to the link).
    A chunk takes a lane once the link holds 2 MiB more for its peer than the lane.
    Worth it where a node has cores to spare and links faster than one core's QUIC
    (about 1 Gbit/s on qh3): a chunk through a lane costs two hand-overs more
    (bench/lanes.py). Not used under the WAN emulator, which must see every datagram."""
    lane_base_port: int = 0
    """Lane process i listens on UDP ``lane_base_port + i`` (open them in the firewall);
    0 takes any free ports."""


Dissemination = Literal["tree", "direct", "gossip"]
StrategyChoice = Literal["auto", "tree", "ring", "hierarchical"]


@dataclass(frozen=True, slots=True)
class MeshSection:
    """Membership (SWIM with Lifeguard), the RTT map, routing and dissemination.

    Derived values, with N the number of live members and A the local health score
    (core.mesh.suspicion, 0 when healthy):

    - probe period = ``probe_interval_s * (A + 1)``; each member is probed about once
      every ``(N - 1) * probe_interval_s`` by each other member, so some member probes
      a crashed node after ``probe_interval_s`` on average.
    - direct probe deadline = ``clamp(srtt + 4 * rttvar + probe_margin_s,
      probe_timeout_min_s, probe_timeout_max_s) * (A + 1)`` from that peer's measured
      RTT (``probe_timeout_initial_s`` before the first sample): far peers get longer,
      near ones shorter deadlines.
    - indirect deadline = direct deadline + the helper's deadline + the helper→target
      RTT from the map.
    - suspicion timeout: from ``max = suspicion_max_mult * min`` down to
      ``min = suspicion_mult * max(1, log10(N)) * probe_interval_s`` as up to
      ``suspicion_confirmations`` other members confirm.
    - each update is piggybacked ``retransmit_mult * ceil(log10(N + 1))`` times.
    """

    probe_interval_s: float = 0.4
    """Time between this node's probes (one member per probe, round robin)."""
    probe_timeout_min_s: float = 0.02
    probe_timeout_max_s: float = 1.5
    probe_timeout_initial_s: float = 1.0
    """Direct probe deadline for a peer we have no RTT sample for yet."""
    probe_margin_s: float = 0.01
    """Added to srtt + 4 rttvar: scheduling noise at both ends."""
    indirect_probes: int = 3
    """Members asked to probe a target that missed its direct deadline (SWIM's k)."""
    suspicion_mult: float = 2.0
    suspicion_max_mult: float = 3.0
    suspicion_confirmations: int = 3
    """Lifeguard's K: independent suspicions that shrink the timeout to its minimum."""
    awareness_max: int = 8
    """Local health multiplier cap: deadlines stretch at most this many times."""
    gossip_interval_s: float = 0.05
    """How often queued updates are pushed to ``gossip_fanout`` members."""
    gossip_fanout: int = 3
    retransmit_mult: int = 4
    piggyback_bytes: int = 1024
    """Updates carried by one probe or ack, at most (keeps them in one QUIC packet)."""
    sync_interval_s: float = 30.0
    """Full state exchange with one random member (push-pull anti-entropy)."""
    reconnect_interval_s: float = 2.0
    """How often a node tries one member it believes dead (partition healing)."""
    gossip_to_dead_s: float = 60.0
    """For this long after a death, the dead member still gets gossip (so that a
    healed partition hears the refutations)."""
    dead_reap_s: float = 6 * 3600.0
    """Dead and departed members are forgotten after this long."""
    address_change_min_s: float = 10.0
    """A member's new address (in its signed Alive) is taken at most this often: a
    member can sign any address as its own, and each new one makes every node dial
    it."""
    rejoin_min_s: float = 1.0
    """A member that left is taken back at most this long after its departure (an
    Alive sooner is held until then): one leaving and rejoining in a loop would change
    every node's view, and with it the routes and trees, each time."""
    max_members: int = 4096
    """Members the table holds at most (each enters only with a credential checked
    here, so this bounds memory, not trust); past it the oldest dead or departed one
    is forgotten, and with none, a new member is refused (counted)."""
    join_retry_s: float = 1.0
    leave_propagate_s: float = 2.0
    """``leave`` waits at most this long for its departure to spread."""
    link_publish_min_s: float = 0.5
    """A node republishes its measured links at most this often, and takes a member's
    at most this often (a sooner version is held until due: a member republishing at
    will would make every node replan its trees for every chunk)..."""
    link_refresh_s: float = 30.0
    """...and at least this often."""
    link_change_ratio: float = 0.1
    """A measured RTT is republished when it moves by more than this fraction..."""
    link_rate_change_ratio: float = 0.25
    """...and a measured link rate when it moves by more than this fraction (rates
    vary more than RTTs from transfer to transfer)."""
    link_sync_interval_s: float = 1.0
    """At most this often a node pushes its whole link state to a peer whose link-state
    digest (carried by every probe and ack) differs from its own."""
    link_sync_max_members: int = 64
    """Digest-driven link-state pushes run in meshes up to this size, where every
    node routes over the full map; past it a push would be most of a large map each
    second, and the map converges by piggyback and the periodic sync alone."""
    link_state_max_peers: int = 32
    """A node publishes its nearest measured links, at most this many: enough for
    routes and trees in meshes of tens of nodes, bounded for large ones."""
    link_change_min_s: float = 0.005
    """...and by more than this (measurement noise must not reshape trees)."""
    route_hysteresis: float = 0.1
    """A new route replaces the current one only if it is faster by this fraction."""
    relay_penalty_s: float = 0.002
    """Cost of one relay hop (receive, check, forward), added to each path."""
    default_rate_bps: float = 1e9
    """Link rate assumed where none is known (trees count serialization time)."""
    tree_max_fanout: int = 4
    """Children per node in a dissemination tree: the uplink is shared by them. A
    round's large trees planned together (``node_uplink_bps`` set, up to 12 nodes)
    take no limit: the uplink's time is counted there."""
    tree_relay_margin: float = 0.1
    """A node takes a chunk through a relay only when that arrives sooner by this
    fraction (each relay hop's arrival counts ``1 + margin`` times). Near-ties go
    direct: a relay costs more than ``relay_penalty_s`` on a busy node, and which
    side of a near-tie the measured RTTs fall on changes from run to run."""
    dissemination: Dissemination = "tree"
    """``tree`` (routed), ``direct`` (origin to every node) or ``gossip`` (random push)."""
    tree_chunk_bytes: int = 4096
    """Chunk size the trees are optimised for (serialization per hop) where no round's
    size is known (core.mesh.strategy plans for the round's pieces)."""
    strategy: StrategyChoice = "auto"
    """How a round's payloads spread (``dissemination = "tree"``; core.mesh.strategy):
    ``tree`` (per-origin routed trees), ``ring`` (once around a ring ordered by
    measured cost), ``hierarchical`` (within clusters of nearby nodes, between their
    leaders, then back), or ``auto``: the least round time the cost model predicts
    from the published link state and the round's size, chosen by each origin at its
    round boundaries (its chunks name the strategy, so relays follow it)."""
    rate_probe_bytes: int = 0
    """Filler sent down a link to measure it (core.link.rateprobe): a link no one has
    measured from this node (its peer published no rate for it), or one that reads
    below ``rate_probe_below`` of this node's best while this node sends nothing
    else, in frames of at most 256 KiB that the peer times as any bulk frame
    (core.link.throughput) and drops. 0 (the default): no probes. Size it to a few
    bandwidth-delay products of the links: a probe of a few hundred KiB on an idle
    connection measures QUIC's slow start more than the link (256 KiB read 4 Mbit/s on
    a 140 ms, 20 Mbit/s emulated path, where a 2 MB transfer read 20)."""
    rate_probe_interval_s: float = 60.0
    """A link is probed at most this often (a link that still reads low after its
    probe, up to 8 times less often), and never while bulk data waits for it."""
    rate_probe_below: float = 0.5
    """A measured link reading below this fraction of the second fastest link this
    node's peers published from it (at most ``default_rate_bps`` and ``node_uplink_bps``;
    the second, so one member claiming a fast link cannot draw probes down every other)
    is probed too, when this node sends nothing else: a link the strategy in force
    leaves idle keeps the reading of whatever last crossed it, and one measured while
    its sender fed several links reads its share of the uplink. 0: unmeasured links
    only."""
    carry_plans: bool = True
    """A large piece (over 64 KiB) carries the tree its origin planned for it, and every
    relay forwards it by that plan rather than by the trees of the state it holds when
    the piece arrives (core.mesh.carriedplan): a 1 MiB piece spends seconds per hop
    while RTTs and rates are republished, and relays that disagree send second copies
    or none. Costs about 2 + name bytes per node on each large piece. Nodes of versions
    before it refuse such pieces: keep it off until every node of a mesh has it."""
    pace_gain: float = 1.5
    """Bulk bytes to a peer go no faster than this times the rate that peer published
    for the link from this node (core.link.pacer); 0: no pacing. QUIC's congestion
    control finds a path's rate by overflowing its bottleneck queue, and a queue short
    against the path's bandwidth-delay product turns that into a loss burst in every
    transfer: 1 MB broadcasts over the emulated multi-cloud matrix took 2.1-2.3x the
    store-and-forward optimum round after round unpaced, 1.1-1.3x from the third
    round paced at 1.5x the measured rate. Well above 1, because the measurement reads
    low (slow start, losses) and climbs only by what the pace lets through: at 1.1x
    the rounds stayed at 1.8-1.9x. The LAN and local presets do not pace."""
    strategy_hysteresis: float = 0.1
    """``auto`` leaves the strategy in force only for one predicted faster by this
    fraction (predictions move with every RTT and rate sample)."""
    strategy_piece_bytes: int = 1 << 20
    """The most one chunk carries (``codec.chunk_payload_bytes`` and its header): a
    round travels in pieces of at most this, which the cost model counts."""
    cluster_rtt_s: float = 0.02
    """``hierarchical``: nodes joined by links under this RTT are one cluster."""
    node_uplink_bps: float = 0.0
    """What one node's uplink carries in all, shared by its links (its NIC or access
    link; the same for every node of the mesh), for the trees and the cost model. 0
    (not known): a node sends one copy at a time at its links' rates, and a tree node
    takes at most ``tree_max_fanout`` children; ``inf``: a node's links do not share a
    bottleneck (as the WAN emulator's links without an uplink), so an origin may send
    to every node at once. With a rate set, a round's large pieces get their trees
    planned together (core.mesh.planners.tree_plan): each node's uplink carries its
    copies in every origin's tree, and the relaying is spread by what each sends."""
    heads_interval_s: float = 0.25
    """How soon after what it holds changed a node tells ``heads_fanout`` members (its
    highest chunk per origin), and how often it checks for chunks to ask again for."""
    heads_idle_interval_s: float = 4.0
    """How often a node repeats those announcements while what it holds is unchanged
    (for the members a lost message or a random pick left out)."""
    heads_fanout: int = 2
    repair_after_s: float = 0.3
    """A chunk known to exist but missing this long is requested from a holder (or
    longer: as long as the tree's copies are measured to come late, core.mesh.lag)."""
    repair_after_max_s: float = 10.0
    """The longest repair wait the measured tree lag can set (what a relay that sends
    its copies late on purpose can hold a repair to), at most ``chunk_retain_s``."""
    chunk_retain_s: float = 30.0
    """Delivered chunks are kept this long for peers that missed them."""
    own_chunk_retain_s: float = 120.0
    """A node keeps the chunks it published this long (in at most half of
    ``chunk_retain_bytes``; past the bound others' chunks go first): every second
    repair ask goes to a chunk's origin, and a round of large pieces on slow links can
    outlast ``chunk_retain_s``."""
    chunk_retain_bytes: int = 256 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class TrainSection:
    """The training hook and the daemon's trainer socket (ciuic_p2p.train).

    The update rule (docs/concepts/update-rule.md): each local step's
    optimizer delta goes through the error-feedback codec (``codec`` section); every
    replica, its own included, adds ``1/N`` of each chunk it applies, N being the
    number of training replicas it knows alive. Derived values:

    - a step waits while some live replica's newest applied step is more than
      ``staleness_bound_steps`` behind this one (the wait is counted);
    - a chunk is sent every ``send_interval_steps`` steps; while the daemon holds more
      than ``backlog_high_bytes`` unsent, the interval doubles (up to
      ``max_send_interval_steps``, merged steps: the residual carries them) and the
      density halves (down to ``min_density``); below ``backlog_low_bytes`` both
      recover one notch per send;
    - every ``consensus_interval_steps`` a replica sends the next of
      ``consensus_fragments`` fragments of its parameters (INT8, dense) and every
      receiver moves ``consensus_mix`` of the way toward them.
    """

    socket_path: str = ""
    """The daemon's trainer socket; empty: ``trainer.sock`` in ``node.runtime_dir``."""
    staleness_bound_steps: int = 64
    send_interval_steps: int = 1
    max_send_interval_steps: int = 16
    min_density: float = 0.0005
    backlog_high_bytes: int = 1 << 20
    """The high backlog mark's floor; the mark is ``backlog_high_sends`` sends when that
    is more (one send is 2.1 MB at 100M parameters and 1%: a fixed MiB is no mark)."""
    backlog_low_bytes: int = 256 * 1024
    backlog_high_sends: float = 4.0
    """High backlog mark, in units of this replica's mean update send."""
    backlog_low_sends: float = 1.0
    consensus_interval_steps: int = 8
    """Steps between two consensus rounds, each of one fragment (0: no mix). In
    ``outer`` mode rounded up to whole rounds (a fragment goes with a round). A round
    of the mix costs ``1/consensus_fragments`` byte per parameter."""
    consensus_fragments: int = 64
    """The parameters are mixed in this many fragments, one per round in turn (a
    round then costs about 0.8 of a 1% update, and all of the model is mixed every
    ``consensus_interval_steps * consensus_fragments`` steps)."""
    consensus_mix: float = 0.5
    update_norm_max_ratio: float = 200.0
    """A peer chunk whose RMS exceeds this times the running RMS of this replica's own
    chunks (of the same bucket), or of the replicas' lower median when that is more,
    per step the update covers (since its origin's previous one, at most
    ``max_send_interval_steps``, or ``inner_steps`` in outer mode), is refused: a faulty
    node cannot blow up the model. What a chunk under it moves is clipped per step it
    covers (``influence_clip_ratio``): this bound only keeps garbage out. At 50, honest
    updates of a replica back from its daemon's restart (its loss still higher, its
    SGD steps larger) were refused at 52 to 66 times the median, 5 a run in 1 run of 3."""
    norm_warmup_chunks: int = 10
    """Own chunks seen before the norm bound applies."""
    influence_clip_ratio: float = 3.0
    """One peer update (an origin, a step, a bucket) is taken at most at this times
    the lower median of the running update norms of this replica and the origins it
    hears (an update that merged k steps: k times that), and one origin moves this
    replica by at most this times that norm per step the run advances, however it
    numbers its updates: one member moves a replica by about its honest share
    (docs/concepts/security.md). 3: at 8 a member that republished the others'
    progress sign-flipped ruined every honest digits model on real daemons
    (bench/hostile.py); at 2 the honest digits runs lost 2.8% of their final loss
    (a quarter of the honest chunks taken clipped), at 3 0.4% (one in fifteen)."""
    influence_clip_ratio_rounds: float = 8.0
    """``influence_clip_ratio`` in ``outer`` mode, where an update is a round's
    pseudo-gradient: those vary more between replicas than one step's, and 2 cost the
    digits outer run 15% of its final loss (bench/training.py); the budget per step of
    the run and the direction weight still hold a member there."""
    influence_disagreement: float = 0.1
    """An origin whose updates' running cosine with this replica's own recent updates
    (on the coordinates each touches) falls below zero beyond its noise (the running
    mean plus two standard errors) loses weight, linearly, down to none at minus this;
    an origin whose updates weigh nothing is not counted among the replicas N that
    every chunk is weighted by, and its consensus fragments are not mixed (0: off).
    Honest digits replicas agree at about +0.13, a sign-flipped copy at -0.36 to -0.57
    (bench/hostile.py)."""
    influence_window_sends: int = 4
    """The own updates the direction is taken from: the last one to two windows of
    this many sends (in outer mode, of one send: a round). Short, because near a
    minimum with momentum a replica's recent steps overshoot and the others' next ones
    point back: against 16 to 32 sends honest replicas read as disagreeing (-0.2 to
    -0.6) and lost half their weight; against 4 to 8, +0.06 to +0.1."""
    set_aside_refusals: int = 32
    """An origin whose payloads are refused this many times within
    ``staleness_bound_steps`` steps is set aside (0: never)."""
    set_aside_steps: int = 1000
    """How long an origin is set aside, in this replica's steps: its payloads are
    refused unread, it is not waited for, and the trainer logs how to revoke it."""
    excused_twice_not_waited: bool = True
    """A replica excused from the staleness bound twice is not waited for again (it
    is still applied): a member cannot stall the run ``stall_grace_s`` at a time by
    falling behind and catching up in a loop."""
    params_distance_max_ratio: float = 0.8
    """A peer's consensus fragment whose RMS distance from this replica's parameters
    exceeds this times their RMS is refused (parameters held against parameters: the
    bound does not shrink as updates do near convergence; a faulty node sending zeros
    is 1.0 away). Honest replicas early in training, their chunks late on a loaded
    host and staleness unbounded, were measured 0.73 to 0.94 apart
    (tests/train/test_embedded.py beside three busy processes on two cores): 0.5
    refused them; 0.8 still refuses zeros, and ``staleness_bound_steps`` keeps honest
    drift below it. ``update_norm_max_ratio`` times the own updates' RMS is the floor,
    for parameters near zero."""
    mode: TrainMode = "step"
    """``step``: every ``send_interval_steps`` steps the local progress goes out and
    peers' chunks are added at ``1/N`` (the rule above). ``outer``: rounds of
    ``inner_steps`` steps of the user's optimizer; at the end of each, the round's
    progress (the pseudo-gradient, with error feedback) goes out, and the mean of the
    replicas' round goes in through an outer step (``outer_optimizer``) as it arrives,
    one round late, while the next round computes (docs/concepts/outer-steps.md)."""
    inner_steps: int = 30
    """``outer`` mode: steps per round (H). ``staleness_bound_steps`` must be at least
    twice this: a round travels while the next one computes."""
    outer_optimizer: OuterOptimizer = "average"
    """``outer`` mode: ``average`` moves every replica by ``outer_lr`` times the mean of
    the rounds (SparseLoCo); ``nesterov`` runs Nesterov momentum (``outer_momentum``)
    on it (DiLoCo: lr 0.7, momentum 0.9)."""
    outer_lr: float = 1.0
    outer_momentum: float = 0.9
    """``nesterov`` only. The momentum buffer is dense: 4 bytes per parameter more."""
    finish_timeout_s: float = 60.0
    """How long :meth:`finish` waits for the other replicas' last chunks, and as long
    again for their copies in the last round (``finish_average``)."""
    finish_dense: bool = True
    """:meth:`finish` sends everything error feedback still holds as one dense INT8
    update, so every replica ends with the same parameters up to its rounding (the
    residual of top-k at 5% measured 0.05 to 0.5 in L2 on digits, and each replica's
    own kept it apart from the others for good). It costs about one byte per
    parameter per replica on the wire, once per run, and while :meth:`finish` runs
    about 9 bytes per element of the largest bucket and 4 per parameter (the sent
    values, until settled). False: the last update is sparse like every other and
    each replica ends apart by its residual. Ignored in ``outer`` mode (a round's
    residual goes with the round)."""
    finish_average: FinishAverage = "fp16"
    """:meth:`finish` ends with a last round in which every replica averages the same
    copies of all the replicas' parameters, its own included, in this dtype, so the
    run ends as one model (up to the rounding of fp32 additions) whichever node a user
    saves it from (core.replica.final). Its members are the replicas whose DONE was
    heard, at a step within ``staleness_bound_steps`` of this one's. It costs one copy
    per replica on the wire, once per run (2 bytes per parameter at ``fp16``: a node
    receives that from each other replica). While :meth:`finish` runs it holds 2 bytes
    per parameter (the own copy; 4 at ``fp32``), one bucket's chunks as they are sent,
    and up to 12 bytes per element of the largest bucket; a peer's copy that comes
    before this replica's round is held until then (its values, at most one model's
    worth per peer). The copies' rounding (fp16: 2^-11 relative per element above 6e-5,
    where fp16 turns subnormal) is in the end model. ``off``:
    each replica keeps its own parameters (they end apart by the last updates' rounding
    and what the consensus mix did not cover)."""
    finish_average_distance_max_ratio: float = 0.2
    """A peer's copy in the last round whose RMS distance from this replica's copy
    exceeds this times their RMS (the range's, or its bucket's when more) is refused:
    a member moves a replica at most this far, divided by the number of copies that
    reached it (M when every member's came; fewer when some did not).
    Honest replicas end a run about 1% apart (2-3% after a daemon restart); replicas
    that started from different weights are about 1.4 apart and are not averaged."""
    stall_grace_s: float = 0.5
    """A step waits at most this long for replicas past the staleness bound; then it
    goes on without them (counted as ``excused``) until their chunks catch up, so a
    node that dies stalls the others this long, not until the mesh declares it dead."""


@dataclass(frozen=True, slots=True)
class StoreSection:
    """The shared store and state sync (core.store, daemon.store)."""

    piece_bytes: int = 256 * 1024
    """Objects travel in pieces of this size, each verified by its BLAKE2b digest."""
    window_pieces: int = 8
    """Piece requests in flight per donor."""
    max_inflight_bytes: int = 3 * 1024 * 1024
    """Piece bytes one fetch has asked for and not yet received, over all its donors
    (each gets an equal share: at least one piece, at most ``window_pieces``). What is
    in flight lands in this node's UDP receive buffer whenever its event loop falls
    behind, and a datagram that finds the buffer full is lost, which QUIC answers by
    slowing down for round trips: in bench/fetchload.py, 8 pieces from each of 3
    donors lost 3,753 datagrams during training and took 35.6 s for 81 MB; capped at
    3 MiB, none and 26.7 s. Keep it under the receive buffer's payload capacity (the
    kernel charges about twice each datagram's size)."""
    max_donors: int = 4
    """Donors one fetch stripes over (those holding the exact same content)."""
    upload_slots: int = 1
    """Fetchers a holder serves at once; the others are told BUSY and go elsewhere."""
    upload_idle_s: float = 5.0
    upload_rate_bps: float = 0.0
    """Pace each upload to at most this many bits per second, so that a donor's own
    training traffic keeps flowing (0: as fast as the link and credit allow)."""
    query_timeout_s: float = 2.0
    """How long a fetch waits for members to say what they hold."""
    piece_timeout_s: float = 10.0
    """A donor that sends nothing for this long while asked is replaced."""
    retry_s: float = 0.5
    fetch_timeout_s: float = 120.0
    unknown_rtt_s: float = 0.5
    """RTT assumed for a donor the RTT map does not know yet."""
    max_corrupt_per_donor: int = 3
    """Pieces with a wrong digest after which a donor is no longer asked."""
    replicas: int = 2
    """Other members a ``put`` has hold a copy before it returns."""
    max_object_bytes: int = 4 << 30
    """The largest object this node fetches or takes from its trainer: an offer whose
    manifest claims more is not taken (and nothing is allocated for it; a fetch holds
    only the pieces that arrived)."""
    max_held_bytes: int = 16 << 30
    """What this node holds for others at most: a member's HOLD past it is refused."""
    max_upload_queue_bytes: int = 16 << 20
    """Pieces queued for one fetcher and not yet sent, at most; a GET beyond it is
    answered BUSY. Honest fetchers ask for ``max_inflight_bytes`` at a time."""
    state_version_slack_steps: int = 1000
    """State sync takes any replica's state at most this many steps behind the newest
    offered (the nearest of those, by RTT and load)."""
    state_agreement_tolerance: float = 0.5
    """A joiner takes a replica's state, where the run has two or more other replicas,
    only when samples of the others' states agree with it: at least one, and no fewer
    than disagree, within this relative distance (||a - b|| / max(||a||, ||b||) over
    the sampled parameters; docs/concepts/security.md gives the honest distances)."""
    state_vouchers: int = 4
    """Other replicas a joiner asks for a sample of their state, at most."""
    max_version_jump: int = 100_000
    """Another writer's version of a name more than this above the newest version
    of it held here is not taken (a member's HOLD, a prefetched state): versions
    grow by one per put and by the steps between snapshots, so a jump past this is
    a claim to be "the newest forever"."""
    prefetch_state: bool = True
    """A daemon that served a run's trainer before (``STATE_DIR/run``) fetches the
    run's state as soon as it has rejoined after a restart, while its trainer starts
    (imports, model, CUDA); the trainer then takes that state and the chunks held
    since, instead of asking the mesh once it is up."""
    sync_optimizer_state: bool = True
    """State sync and checkpoints carry the optimizer's state (momentum, Adam moments)
    besides the parameters."""
    checkpoint_dir: str = ""
    """Where the hook writes checkpoints (the newest and the one before it), for the
    trainer's account to write. Empty: where the daemon names when the trainer
    attaches (``checkpoints`` in ``node.state_dir``, 0700: for a trainer that runs as
    the daemon's user), or, where the trainer cannot write there (another account),
    ``$XDG_STATE_HOME/ciuic-p2p/checkpoints`` (``~/.local/state/...``), else none.
    ``off``: none. ``attach(checkpoint_dir=...)`` overrides
    it (``""``: none)."""
    checkpoint_interval_s: float = 300.0
    """0: only on SIGTERM, when the daemon stops, and at the end."""
    stop_checkpoint_wait_s: float = 10.0
    """A daemon stopping with a trainer attached asks it for a checkpoint and waits
    this long for it before it leaves the mesh (0: it does not ask). The trainer writes
    it at its next step and goes on, reconnecting when a daemon is back."""


@dataclass(frozen=True, slots=True)
class LogSection:
    """Logging (see ciuic_p2p.logsetup)."""

    format: LogFormat = "auto"
    """``auto``: JSON lines under systemd/journald or when stderr is not a terminal,
    readable console output in a terminal."""
    level: LogLevel = "info"
    """Lowest level that is emitted."""
    rate_limit_burst: int = 5
    """A repeated warning (same event and peer) is written at most this many times per
    ``rate_limit_window_s``; then one line says how many were suppressed."""
    rate_limit_window_s: float = 60.0


@dataclass(frozen=True, slots=True)
class WebSection:
    """The daemon's HTTP endpoint: the live status page (``/``), its JSON
    (``/api/status``) and Prometheus metrics (``/metrics``); see daemon.web."""

    enabled: bool = True
    listen_host: str = "127.0.0.1"
    """Loopback by default: the page shows the mesh's addresses; opening it is explicit."""
    port: int = 7947
    """TCP port; 0 picks a free one (logged, and shown by ``ciuic-node status``)."""
    refresh_s: float = 1.0
    """How often the page refreshes itself."""
    header_timeout_s: float = 10.0
    """A request's headers must arrive within this, and an idle connection closes
    after it (a local user's half-open requests cannot pile up)."""
    max_connections: int = 64
    """Connections open at once. Past it a new one closes the oldest half-open one (no
    request being handled; one that sent part of a head first), and a new connection
    opens up to twice as many while the others have not yet had 0.5 s to send their
    head; only when none of them may be closed is a new one closed at once. One source
    address holds at most half of it half-open (daemon.web)."""


@dataclass(frozen=True, slots=True)
class AuditSection:
    """The tamper-evident audit log (see core.audit): hash-chained entries signed with
    the node key, in JSON-lines files that rotate without breaking the chain."""

    enabled: bool = True
    dir: str = ""
    """Where the files go; default: ``audit`` in ``node.state_dir``."""
    interval_s: float = 60.0
    """Traffic (chunks received and forwarded per origin) is summed over this long and
    written as one entry per interval, not per chunk."""
    rotate_bytes: int = 16 * 1024 * 1024
    """A file past this size is closed and a new one continues the chain."""
    max_dir_bytes: int = 256 * 1024 * 1024
    """The directory's bound: past it the oldest files are deleted at a rotation and a
    ``pruned`` entry says so (``audit verify`` then checks the chain from there). 0
    keeps every file (the disk is then the bound: a full disk stops the log, never the
    daemon)."""
