//! Conversations plus an arrival schedule: the unit replayed identically for every policy.

use std::borrow::Cow;

use rand::{Rng, SeedableRng};
use rand_pcg::Pcg64;
use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

use crate::WorkloadError;
use crate::spec::{ArrivalSpec, MAX_CONVERSATIONS, OpenStart, Sharing, Sizing, WorkloadSpec};
use crate::text::english_like;
use crate::walk::SKIP_WINDOW_DRAWS;
use crate::zipf::Zipf;

/// Version of the serialized plan layout, written as the plan's first byte and hashed with the
/// rest, so fingerprints of plans of different formats never coincide. Bumped whenever [`Plan`]'s
/// fields or their encoding change (3: prefix groups and conversation sharing in the spec, each
/// conversation's group; 4: the open loop's start; 5: MessagePack (`rmp-serde`) after the
/// format byte, in place of bincode 2 — formats 1–4 were bincode, whose first byte was the
/// format number too, so [`Plan::from_bytes`] names an old plan's format; 6: an arrival's
/// `prime` flag, [`OpenStart::Primed`]).
pub const PLAN_FORMAT: u8 = 6;

/// The last plan format written with bincode (`=2.0.1`, `config::standard()`).
const LAST_BINCODE_FORMAT: u8 = 4;

/// One conversation's scripted text. Turn `k` (1-based) sends the system message (its group's
/// shared prefix, if any, then `system`), then for each earlier turn `j` the pair
/// `users[j-1]`, `replies[j-1]`, then `users[k-1]`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Conversation {
    /// The conversation's own context: the whole system message without prefix groups; with
    /// them, the private context sent after the group's shared prefix
    /// ([`Plan::group_prefixes`], stored once per group).
    pub system: String,
    /// One user message per turn.
    pub users: Vec<String>,
    /// Scripted assistant replies; one per turn except the last (whose reply is never re-sent).
    pub replies: Vec<String>,
    /// The prefix group this conversation belongs to (`None` without prefix groups).
    pub group: Option<u32>,
}

/// Chat role of a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// The context prefix.
    System,
    /// A user turn.
    User,
    /// A scripted assistant reply.
    Assistant,
}

impl Role {
    /// The OpenAI wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
        }
    }
}

/// One chat message from a plan: borrowed, except a grouped conversation's system message
/// (its group's shared prefix joined to its private context).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message<'a> {
    /// Who speaks.
    pub role: Role,
    /// What is said.
    pub content: Cow<'a, str>,
}

/// One request of a closed-loop user script.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Step {
    /// Conversation index.
    pub conversation: u32,
    /// Turn, 1-based.
    pub turn: u32,
    /// Think time before sending this request, in microseconds.
    pub think_us: u64,
}

/// One request of an open-loop schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Arrival {
    /// Scheduled send time, microseconds after the run starts.
    pub at_us: u64,
    /// Conversation index.
    pub conversation: u32,
    /// Turn, 1-based.
    pub turn: u32,
    /// A priming send ([`OpenStart::Primed`]): the turn is sent with `max_tokens` 1, to put its
    /// history in the cache before the run's Poisson arrivals begin; always in the warm-up.
    pub prime: bool,
}

impl Arrival {
    /// The `max_tokens` this arrival is sent with: 1 for a prime (a prefill), else the plan's
    /// `output_tokens`. The drivers and the simulator both ask here, so they send the same.
    pub fn max_tokens(&self, output_tokens: u32) -> u32 {
        if self.prime { 1 } else { output_tokens }
    }
}

/// When requests are sent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Schedule {
    /// One script per user, sent in order, one request at a time.
    Closed {
        /// `users[u]` is user `u`'s script.
        users: Vec<Vec<Step>>,
        /// `spare_draws[u]`: further Zipf draws of user `u`, taken (in order) in place of
        /// draws skipped because another user owned the conversation (`crate::walk`):
        /// `SKIP_WINDOW_DRAWS - 1` per walk of the script, enough for every walk to skip a
        /// full window; empty with shared conversations (nothing is ever skipped).
        spare_draws: Vec<Vec<u32>>,
    },
    /// Arrivals in time order.
    Open {
        /// Every arrival, sorted by `at_us`.
        arrivals: Vec<Arrival>,
    },
}

/// A complete, replayable workload: parameters, texts and schedule.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    /// The content parameters.
    pub spec: WorkloadSpec,
    /// The arrival parameters.
    pub arrival: ArrivalSpec,
    /// Each prefix group's shared prefix, indexed by group (empty without prefix groups); a
    /// group no conversation belongs to holds an empty string (its text is never drawn).
    pub group_prefixes: Vec<String>,
    /// Every conversation's text.
    pub conversations: Vec<Conversation>,
    /// The schedule drawn from `arrival` and the Zipf law.
    pub schedule: Schedule,
}

/// [`PLAN_FORMAT`] then `value` as MessagePack: the plan's bytes, and what the fingerprints hash.
fn encode<T: Serialize + ?Sized>(value: &T) -> Result<Vec<u8>, WorkloadError> {
    let mut bytes = vec![PLAN_FORMAT];
    rmp_serde::encode::write(&mut bytes, value)
        .map_err(|e| WorkloadError::Encode(e.to_string()))?;
    Ok(bytes)
}

/// Stream tags for [`derive_seed`], so texts and draws never share a random stream.
mod tag {
    pub const SYSTEM: u64 = 1;
    pub const USER: u64 = 2;
    pub const REPLY: u64 = 3;
    pub const CLOSED_USER: u64 = 4;
    pub const OPEN: u64 = 5;
    pub const CLOSED_SPARE: u64 = 6;
    pub const GROUP_TEXT: u64 = 7;
    pub const GROUP_OF: u64 = 8;
    pub const OPEN_START: u64 = 9;
    pub const PRIME_ORDER: u64 = 10;
}

/// A seed for one stream, independent of how many other streams exist, so that (for example)
/// conversation 3's text does not change when the sizing adds conversations.
fn derive_seed(seed: u64, stream: u64, a: u64, b: u64) -> u64 {
    let mut bytes = [0u8; 24];
    bytes[..8].copy_from_slice(&stream.to_le_bytes());
    bytes[8..16].copy_from_slice(&a.to_le_bytes());
    bytes[16..].copy_from_slice(&b.to_le_bytes());
    xxh3_64_with_seed(&bytes, seed)
}

/// How a workload's conversations are laid out: each one's private context length and group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    /// Each conversation's context at turn 1 in estimated tokens: without prefix groups its
    /// whole context prefix, with groups the private context after the group's shared prefix.
    pub private_tokens: Vec<u64>,
    /// Each conversation's prefix group; empty without prefix groups.
    pub groups: Vec<u32>,
}

impl Layout {
    /// Groups with at least one conversation (0 without prefix groups).
    pub fn used_groups(&self) -> usize {
        let mut seen: Vec<u32> = self.groups.clone();
        seen.sort_unstable();
        seen.dedup();
        seen.len()
    }

    /// Distinct prefix tokens of all conversations at their last turn: each conversation's
    /// private context, turns and replies, plus each used group's shared prefix once.
    pub fn working_set_tokens(&self, spec: &WorkloadSpec) -> u64 {
        let own: u64 = self
            .private_tokens
            .iter()
            .map(|&p| spec.last_turn_tokens(p))
            .sum();
        own + self.used_groups() as u64 * spec.group_prefix_tokens()
    }
}

/// Conversation `c`'s group: a Zipf draw over the groups from `c`'s own stream, so adding
/// conversations never moves an existing one to another group.
fn group_of(seed: u64, groups: &Zipf, c: u64) -> u32 {
    let mut rng = Pcg64::seed_from_u64(derive_seed(seed, tag::GROUP_OF, c, 0));
    groups.sample(&mut rng) as u32
}

/// The conversations' context lengths and groups (see [`Layout`]).
///
/// With working-set sizing the target is `ratio × capacity_tokens` distinct prefix tokens at the
/// last turn, a shared prefix counted once per group that has a conversation
/// ([`Layout::working_set_tokens`]). The count `n` is the one whose nominal total
/// `n × per-conversation tokens + used groups × shared prefix` is nearest the target (the
/// larger on a tie; without groups that is `round(target ÷ per-conversation tokens)`), and the
/// remainder is spread over the private contexts so that the total is exact to the token.
/// Errors when that would shrink a context below half its nominal length (the capacity is too
/// small for whole conversations of this shape).
pub fn layout(spec: &WorkloadSpec) -> Result<Layout, WorkloadError> {
    spec.validate()?;
    let nominal = u64::from(spec.prefix_tokens);
    let zipf = spec
        .prefix_groups
        .map(|g| Zipf::new(g.count as usize, g.zipf_s))
        .transpose()?;
    let draw_groups = |n: u64| -> Vec<u32> {
        zipf.as_ref().map_or_else(Vec::new, |z| {
            (0..n).map(|c| group_of(spec.seed, z, c)).collect()
        })
    };
    match spec.sizing {
        Sizing::Conversations(n) => Ok(Layout {
            private_tokens: vec![nominal; n as usize],
            groups: draw_groups(u64::from(n)),
        }),
        Sizing::WorkingSet {
            capacity_tokens,
            ratio,
        } => {
            let target = (ratio * capacity_tokens as f64).round();
            let per = spec.last_turn_tokens(nominal);
            let too_many = |n: f64| {
                WorkloadError::InvalidSpec(format!(
                    "working set of {target} tokens needs {n} conversations (max {MAX_CONVERSATIONS})"
                ))
            };
            let estimate = (target / per as f64).round().max(1.0);
            if estimate > MAX_CONVERSATIONS as f64 {
                return Err(too_many(estimate));
            }
            let target = target as u64;
            let (n, groups) = match &zipf {
                None => (estimate as u64, Vec::new()),
                Some(z) => {
                    // The nominal total f(n) = n·per + used(n)·shared grows strictly with n:
                    // walk up to the first n whose total reaches the target, then keep it or
                    // the one before, whichever is nearer.
                    let shared = spec.group_prefix_tokens();
                    let mut seen = vec![false; z.len()];
                    let (mut used, mut below, mut groups) = (0u64, 0u64, Vec::new());
                    loop {
                        let c = groups.len() as u64;
                        if c >= MAX_CONVERSATIONS {
                            return Err(too_many(c as f64 + 1.0));
                        }
                        let g = group_of(spec.seed, z, c);
                        if !std::mem::replace(&mut seen[g as usize], true) {
                            used += 1;
                        }
                        groups.push(g);
                        let total = (c + 1) * per + used * shared;
                        if total >= target {
                            let n = if c > 0 && target - below < total - target {
                                c
                            } else {
                                c + 1
                            };
                            groups.truncate(n as usize);
                            break (n, groups);
                        }
                        below = total;
                    }
                }
            };
            let layout = Layout {
                private_tokens: vec![nominal; n as usize],
                groups,
            };
            let deficit = i128::from(target) - i128::from(layout.working_set_tokens(spec));
            let base = deficit.div_euclid(i128::from(n));
            let extra = deficit.rem_euclid(i128::from(n));
            let floor = (nominal / 2).max(1) as i128;
            let mut private_tokens = Vec::with_capacity(n as usize);
            for i in 0..n {
                let p = nominal as i128 + base + i128::from(i128::from(i) < extra);
                if p < floor {
                    return Err(WorkloadError::InvalidSpec(format!(
                        "working set {ratio} × {capacity_tokens} tokens is too small for \
                         conversations of {per} tokens: prefixes would shrink to {p} tokens; \
                         raise the ratio or capacity, or give a conversation count"
                    )));
                }
                private_tokens.push(p as u64);
            }
            Ok(Layout {
                private_tokens,
                ..layout
            })
        }
    }
}

/// Context-prefix lengths (estimated tokens at turn 1), one per conversation: with prefix
/// groups, the private contexts after the shared prefix ([`layout`] has the groups too).
pub fn prefix_lengths(spec: &WorkloadSpec) -> Result<Vec<u64>, WorkloadError> {
    Ok(layout(spec)?.private_tokens)
}

/// The text of group `group`'s shared prefix: exactly `prefix_tokens × bytes_per_token` bytes,
/// opening with a line that names the group (so two groups never share a first block) and
/// ending with a newline (so the private context after it starts a fresh line and token).
fn group_text(spec: &WorkloadSpec, group: u32) -> String {
    let len = spec.group_prefix_tokens() as usize * spec.bytes_per_token as usize;
    let mut text = english_like(
        derive_seed(spec.seed, tag::GROUP_TEXT, u64::from(group), 0),
        &format!("Group {group} shared prefix. "),
        len.saturating_sub(1),
    );
    text.push('\n');
    text
}

impl Plan {
    /// Of the open-loop arrivals scheduled in `[from_us, to_us)`, the share that are a cold
    /// resume ([`cold_resume_share`]); `None` for a closed loop or a window without arrivals.
    pub fn cold_resume_share(&self, from_us: u64, to_us: u64) -> Option<f64> {
        let Schedule::Open { arrivals } = &self.schedule else {
            return None;
        };
        let zipf = Zipf::new(self.conversations.len(), self.spec.zipf_s).ok()?;
        cold_resume_share(
            arrivals,
            &steadily_cached(&self.spec, &zipf),
            from_us,
            to_us,
        )
    }

    /// Draws the conversations and the schedule. Deterministic: the same arguments give a
    /// byte-identical plan.
    pub fn build(spec: &WorkloadSpec, arrival: &ArrivalSpec) -> Result<Plan, WorkloadError> {
        spec.validate()?;
        arrival.validate()?;
        let layout = layout(spec)?;
        let bpt = spec.bytes_per_token as usize;
        let mut group_prefixes: Vec<String> =
            vec![String::new(); spec.prefix_groups.map_or(0, |g| g.count as usize)];
        for &g in &layout.groups {
            if group_prefixes[g as usize].is_empty() {
                group_prefixes[g as usize] = group_text(spec, g);
            }
        }
        let conversations: Vec<Conversation> = layout
            .private_tokens
            .iter()
            .enumerate()
            .map(|(c, &prefix)| {
                let c64 = c as u64;
                let group = layout.groups.get(c).copied();
                let system = english_like(
                    derive_seed(spec.seed, tag::SYSTEM, c64, 0),
                    &format!("Conversation {c} context. "),
                    prefix as usize * bpt,
                );
                let users = (0..spec.turns)
                    .map(|k| {
                        english_like(
                            derive_seed(spec.seed, tag::USER, c64, u64::from(k)),
                            "",
                            spec.user_tokens as usize * bpt,
                        )
                    })
                    .collect();
                let replies = (0..spec.turns - 1)
                    .map(|k| {
                        english_like(
                            derive_seed(spec.seed, tag::REPLY, c64, u64::from(k)),
                            "",
                            spec.output_tokens as usize * bpt,
                        )
                    })
                    .collect();
                Conversation {
                    system,
                    users,
                    replies,
                    group,
                }
            })
            .collect();
        let zipf = Zipf::new(conversations.len(), spec.zipf_s)?;
        let schedule = match *arrival {
            ArrivalSpec::Closed {
                users,
                think_mean_s,
                requests_per_user,
            } => {
                // A separate stream, so the scripts are the same draws they would be without
                // spares. Shared conversations are never skipped, so they need none.
                let walks = requests_per_user.div_ceil(spec.turns) as usize;
                let spare_count = match spec.sharing {
                    Sharing::Exclusive => walks * (SKIP_WINDOW_DRAWS - 1),
                    Sharing::Shared => 0,
                };
                Schedule::Closed {
                    users: (0..users)
                        .map(|u| {
                            closed_script(
                                derive_seed(spec.seed, tag::CLOSED_USER, u64::from(u), 0),
                                &zipf,
                                spec.turns,
                                think_mean_s,
                                requests_per_user,
                            )
                        })
                        .collect(),
                    spare_draws: (0..users)
                        .map(|u| {
                            let seed = derive_seed(spec.seed, tag::CLOSED_SPARE, u64::from(u), 0);
                            let mut rng = Pcg64::seed_from_u64(seed);
                            (0..spare_count)
                                .map(|_| zipf.sample(&mut rng) as u32)
                                .collect()
                        })
                        .collect(),
                }
            }
            ArrivalSpec::Open {
                rate_rps,
                duration_s,
                start,
            } => Schedule::Open {
                arrivals: spec_arrivals(spec, &layout, &zipf, rate_rps, duration_s, start),
            },
        };
        Ok(Plan {
            spec: *spec,
            arrival: *arrival,
            group_prefixes,
            conversations,
            schedule,
        })
    }

    /// The full name: content name and arrival name, e.g.
    /// `chat-ws1-cap200000-s0-t6-p1100-u150-o128-seed7-open-l5-d120`.
    pub fn name(&self) -> String {
        format!("{}-{}", self.spec.name(), self.arrival.name())
    }

    /// Serializes: the byte [`PLAN_FORMAT`], then the plan as MessagePack (`rmp-serde`, structs
    /// as arrays, enum variants by name). Deterministic: the same plan gives the same bytes.
    pub fn to_bytes(&self) -> Result<Vec<u8>, WorkloadError> {
        encode(self)
    }

    /// Decodes and checks a plan written by [`Plan::to_bytes`]. The format byte is read first,
    /// so a plan of another format is refused as such (its layout differs, so decoding it whole
    /// would fail with a less useful message); plans of formats 1–4 (bincode) are named as
    /// written by an older kvroute.
    pub fn from_bytes(bytes: &[u8]) -> Result<Plan, WorkloadError> {
        let Some((&format, body)) = bytes.split_first() else {
            return Err(WorkloadError::Decode("the plan is empty".into()));
        };
        if format != PLAN_FORMAT {
            let origin = if (1..=LAST_BINCODE_FORMAT).contains(&format) {
                "the plan was written by an older version of kvroute (bincode plan formats \
                 1-4, before the MessagePack format)"
            } else {
                "the plan was written by another version of kvroute, or is not a plan"
            };
            return Err(WorkloadError::Decode(format!(
                "plan format {format} is not the supported format {PLAN_FORMAT}: {origin}; build \
                 it again (`driver plan`, or rerun the sweep with --fresh)"
            )));
        }
        let mut cursor = std::io::Cursor::new(body);
        let mut de = rmp_serde::Deserializer::new(&mut cursor);
        let plan = Plan::deserialize(&mut de).map_err(|e| WorkloadError::Decode(e.to_string()))?;
        let used = usize::try_from(cursor.position()).unwrap_or(usize::MAX);
        if used != body.len() {
            return Err(WorkloadError::Decode(format!(
                "{} trailing bytes after the plan",
                body.len().saturating_sub(used)
            )));
        }
        plan.check()?;
        Ok(plan)
    }

    /// Fingerprint of the whole plan: xxh3-64 of its bytes ([`Plan::to_bytes`], format byte
    /// included).
    pub fn fingerprint(&self) -> Result<u64, WorkloadError> {
        Ok(xxh3_64(&self.to_bytes()?))
    }

    /// [`Plan::fingerprint`] as 16 lowercase hex digits.
    pub fn fingerprint_hex(&self) -> Result<String, WorkloadError> {
        Ok(format!("{:016x}", self.fingerprint()?))
    }

    /// Fingerprint of the content only (spec and texts, not the schedule), as 16 hex digits:
    /// equal across arrival plans that send the same conversations.
    pub fn workload_fingerprint_hex(&self) -> Result<String, WorkloadError> {
        let bytes = encode(&(&self.spec, &self.group_prefixes, &self.conversations))?;
        Ok(format!("{:016x}", xxh3_64(&bytes)))
    }

    /// Checks internal consistency (indices in range, turns within each conversation,
    /// arrivals sorted), so that a hand-edited or corrupt plan fails here, not mid-run.
    pub fn check(&self) -> Result<(), WorkloadError> {
        let bad = |m: String| Err(WorkloadError::Decode(m));
        self.spec.validate()?;
        self.arrival.validate()?;
        let turns = self.spec.turns as usize;
        for (i, c) in self.conversations.iter().enumerate() {
            if c.users.len() != turns || c.replies.len() + 1 != turns {
                return bad(format!("conversation {i} does not have {turns} turns"));
            }
        }
        self.check_groups()?;
        let in_range = |conv: u32, turn: u32| {
            (conv as usize) < self.conversations.len() && turn >= 1 && turn as usize <= turns
        };
        match &self.schedule {
            Schedule::Closed { users, spare_draws } => {
                for (u, script) in users.iter().enumerate() {
                    if let Some(s) = script.iter().find(|s| !in_range(s.conversation, s.turn)) {
                        return bad(format!("user {u}: step {s:?} out of range"));
                    }
                }
                if spare_draws.len() != users.len() {
                    return bad(format!(
                        "{} spare-draw lists for {} users",
                        spare_draws.len(),
                        users.len()
                    ));
                }
                for (u, spare) in spare_draws.iter().enumerate() {
                    if let Some(c) = spare.iter().find(|&&c| !in_range(c, 1)) {
                        return bad(format!("user {u}: spare draw {c} out of range"));
                    }
                }
            }
            Schedule::Open { arrivals } => {
                if let Some(a) = arrivals.iter().find(|a| !in_range(a.conversation, a.turn)) {
                    return bad(format!("arrival {a:?} out of range"));
                }
                if arrivals.windows(2).any(|w| w[1].at_us < w[0].at_us) {
                    return bad("arrivals are not in time order".into());
                }
                if arrivals.windows(2).any(|w| w[1].prime && !w[0].prime) {
                    return bad("a priming arrival comes after the run's arrivals began".into());
                }
            }
        }
        Ok(())
    }

    /// Every conversation has a group exactly when the spec has prefix groups, in range, and
    /// each group a conversation belongs to has its shared prefix, of the spec's length.
    fn check_groups(&self) -> Result<(), WorkloadError> {
        let bad = |m: String| Err(WorkloadError::Decode(m));
        let count = self.spec.prefix_groups.map_or(0, |g| g.count) as usize;
        if self.group_prefixes.len() != count {
            return bad(format!(
                "{} group prefixes for {count} groups",
                self.group_prefixes.len()
            ));
        }
        let shared_bytes = self.group_prefix_bytes();
        if let Some(g) = self
            .group_prefixes
            .iter()
            .position(|p| !p.is_empty() && p.len() != shared_bytes)
        {
            return bad(format!("group {g}'s prefix is not {shared_bytes} bytes"));
        }
        for (i, c) in self.conversations.iter().enumerate() {
            match (c.group, count) {
                (None, 0) => {}
                (Some(g), n) if (g as usize) < n => {
                    if self.group_prefixes[g as usize].is_empty() {
                        return bad(format!("conversation {i}'s group {g} has no prefix"));
                    }
                }
                (group, _) => {
                    return bad(format!(
                        "conversation {i} has group {group:?} but the workload has {count} groups"
                    ));
                }
            }
        }
        Ok(())
    }

    /// Bytes of one group's shared prefix (0 without groups).
    fn group_prefix_bytes(&self) -> usize {
        self.spec.group_prefix_tokens() as usize * self.spec.bytes_per_token as usize
    }

    /// Group `group`'s shared prefix as sent (the opening bytes of each of its conversations'
    /// system message); `None` without groups or when no conversation belongs to it.
    pub fn group_prefix(&self, group: u32) -> Option<&str> {
        self.group_prefixes
            .get(group as usize)
            .map(String::as_str)
            .filter(|p| !p.is_empty())
    }

    /// The messages of turn `turn` (1-based) of conversation `conversation`.
    pub fn messages(
        &self,
        conversation: u32,
        turn: u32,
    ) -> Result<Vec<Message<'_>>, WorkloadError> {
        let c = self
            .conversations
            .get(conversation as usize)
            .ok_or_else(|| WorkloadError::OutOfRange(format!("conversation {conversation}")))?;
        if turn == 0 || turn as usize > c.users.len() {
            return Err(WorkloadError::OutOfRange(format!(
                "turn {turn} of conversation {conversation}"
            )));
        }
        let k = turn as usize;
        let mut out = Vec::with_capacity(2 * k);
        let system = match c.group.and_then(|g| self.group_prefixes.get(g as usize)) {
            Some(shared) => Cow::Owned(format!("{shared}{}", c.system)),
            None => Cow::Borrowed(c.system.as_str()),
        };
        out.push(Message {
            role: Role::System,
            content: system,
        });
        for j in 0..k - 1 {
            out.push(Message {
                role: Role::User,
                content: Cow::Borrowed(&c.users[j]),
            });
            out.push(Message {
                role: Role::Assistant,
                content: Cow::Borrowed(&c.replies[j]),
            });
        }
        out.push(Message {
            role: Role::User,
            content: Cow::Borrowed(&c.users[k - 1]),
        });
        Ok(out)
    }

    /// The `x-session-id` of a conversation; stable for a given seed.
    pub fn session_id(&self, conversation: u32) -> String {
        format!("s{}-c{conversation}", self.spec.seed)
    }

    /// Number of requests in the schedule.
    pub fn request_count(&self) -> usize {
        match &self.schedule {
            Schedule::Closed { users, .. } => users.iter().map(Vec::len).sum(),
            Schedule::Open { arrivals } => arrivals.len(),
        }
    }

    /// Estimated tokens of a text: its bytes ÷ `bytes_per_token`.
    pub fn estimate_tokens(&self, text: &str) -> f64 {
        text.len() as f64 / f64::from(self.spec.bytes_per_token)
    }

    /// Distinct prefix tokens of all conversations at their last turn (estimated from bytes):
    /// the working set the sizing targets. A group's shared prefix counts once.
    pub fn working_set_tokens(&self) -> f64 {
        // The last turn sends a conversation's context, every user turn and every reply.
        let own: usize = self
            .conversations
            .iter()
            .map(|c| {
                c.system.len()
                    + c.users.iter().map(String::len).sum::<usize>()
                    + c.replies.iter().map(String::len).sum::<usize>()
            })
            .sum();
        // Only groups with a conversation hold a prefix.
        let shared: usize = self.group_prefixes.iter().map(String::len).sum();
        (own + shared) as f64 / f64::from(self.spec.bytes_per_token)
    }
}

/// Request id of user `user`'s `index`-th request (0-based) in a closed-loop plan.
pub fn closed_request_id(user: usize, index: usize) -> String {
    format!("u{user}-{index}")
}

/// Request id of the `index`-th arrival (0-based) of an open-loop plan.
pub fn open_request_id(index: usize) -> String {
    format!("a{index}")
}

/// An exponential draw with the given mean; inverse transform so the stream is stable.
fn exponential<R: rand::Rng>(rng: &mut R, mean: f64) -> f64 {
    if mean == 0.0 {
        return 0.0;
    }
    let u: f64 = rng.random();
    -mean * (1.0 - u).ln()
}

fn closed_script(
    seed: u64,
    zipf: &Zipf,
    turns: u32,
    think_mean_s: f64,
    requests: u32,
) -> Vec<Step> {
    let mut rng = Pcg64::seed_from_u64(seed);
    let mut out = Vec::with_capacity(requests as usize);
    'outer: loop {
        let conversation = zipf.sample(&mut rng) as u32;
        for turn in 1..=turns {
            if out.len() == requests as usize {
                break 'outer;
            }
            let think_us = (exponential(&mut rng, think_mean_s) * 1e6).round() as u64;
            out.push(Step {
                conversation,
                turn,
                think_us,
            });
        }
    }
    out
}

/// `spec`'s open-loop arrivals: [`open_arrivals`] on its own streams (the one draw
/// [`Plan::build`] and [`steady_state_warmup_s`] share), after the primes of an
/// [`OpenStart::Primed`] start ([`primes`]).
fn spec_arrivals(
    spec: &WorkloadSpec,
    layout: &Layout,
    zipf: &Zipf,
    rate_rps: f64,
    duration_s: f64,
    start: OpenStart,
) -> Vec<Arrival> {
    let stationary_seed = match start {
        OpenStart::Fresh => None,
        OpenStart::Stationary | OpenStart::Primed { .. } => Some(spec.seed),
    };
    let cursor = first_cursors(zipf.len(), spec.turns, stationary_seed);
    let (mut out, begin_s) = match start {
        OpenStart::Primed { tokens_per_s } => {
            primes(spec, layout, zipf, &cursor, f64::from(tokens_per_s))
        }
        OpenStart::Fresh | OpenStart::Stationary => (Vec::new(), 0.0),
    };
    out.extend(open_arrivals(
        derive_seed(spec.seed, tag::OPEN, 0, 0),
        zipf,
        spec.turns,
        rate_rps,
        begin_s,
        duration_s,
        cursor,
    ));
    out
}

/// Each conversation's turn before its first arrival (0: it starts at turn 1).
/// `stationary_seed`: each conversation's first turn is drawn uniformly from its own stream of
/// that seed ([`OpenStart::Stationary`]); `None`, every conversation starts at turn 1.
fn first_cursors(conversations: usize, turns: u32, stationary_seed: Option<u64>) -> Vec<u32> {
    // A stream per conversation, so a conversation's start does not move when the sizing adds
    // conversations.
    match stationary_seed {
        None => vec![0; conversations],
        Some(s) => (0..conversations as u64)
            .map(|c| (derive_seed(s, tag::OPEN_START, c, 0) % u64::from(turns)) as u32)
            .collect(),
    }
}

/// The primes of an [`OpenStart::Primed`] start and the time (s) the Poisson arrivals begin.
/// One prime per conversation the steady state would hold ([`steadily_cached`]) whose first turn
/// (`cursor + 1`) is past turn 1: turn `cursor`, in a seeded random order. Each is scheduled at
/// the estimated prompt tokens of the primes before it ÷ `tokens_per_s` (shared group prefixes
/// counted in every prompt, as each prime's prompt holds them), and the arrivals begin at all
/// their tokens ÷ `tokens_per_s`.
fn primes(
    spec: &WorkloadSpec,
    layout: &Layout,
    zipf: &Zipf,
    cursor: &[u32],
    tokens_per_s: f64,
) -> (Vec<Arrival>, f64) {
    let counted = steadily_cached(spec, zipf);
    let mut order: Vec<u32> = (0..cursor.len() as u32)
        .filter(|&c| counted[c as usize] && cursor[c as usize] >= 1)
        .collect();
    let mut rng = Pcg64::seed_from_u64(derive_seed(spec.seed, tag::PRIME_ORDER, 0, 0));
    // Fisher–Yates by hand on the crate's own stream, so the order is this code's, not a
    // library version's.
    for i in (1..order.len()).rev() {
        let j = (rng.random::<u64>() % (i as u64 + 1)) as usize;
        order.swap(i, j);
    }
    let mut out = Vec::with_capacity(order.len());
    let mut tokens_before = 0u64;
    for c in order {
        let turn = cursor[c as usize];
        out.push(Arrival {
            at_us: (tokens_before as f64 / tokens_per_s * 1e6).round() as u64,
            conversation: c,
            turn,
            prime: true,
        });
        tokens_before += spec.turn_tokens(context_tokens(spec, layout, c), turn);
    }
    (out, tokens_before as f64 / tokens_per_s)
}

/// Estimated tokens of conversation `c`'s context at turn 1: its private context and, with
/// prefix groups, its group's shared prefix.
fn context_tokens(spec: &WorkloadSpec, layout: &Layout, c: u32) -> u64 {
    layout.private_tokens[c as usize] + spec.group_prefix_tokens()
}

/// How long the primes of `spec` under `start` take at their pace (s of the plan's clock): the
/// time the Poisson arrivals begin. 0 for a start without primes.
pub fn prime_period_s(spec: &WorkloadSpec, start: OpenStart) -> Result<f64, WorkloadError> {
    let OpenStart::Primed { tokens_per_s } = start else {
        return Ok(0.0);
    };
    if tokens_per_s == 0 {
        return Err(WorkloadError::InvalidSpec(
            "the primes' pace must be > 0 tokens/s".into(),
        ));
    }
    spec.validate()?;
    let layout = layout(spec)?;
    let zipf = Zipf::new(layout.private_tokens.len(), spec.zipf_s)?;
    Ok(prime_period_with(spec, &layout, &zipf, start))
}

/// [`prime_period_s`] with the layout and Zipf law already drawn (`start` already validated).
fn prime_period_with(spec: &WorkloadSpec, layout: &Layout, zipf: &Zipf, start: OpenStart) -> f64 {
    let OpenStart::Primed { tokens_per_s } = start else {
        return 0.0;
    };
    let cursor = first_cursors(zipf.len(), spec.turns, Some(spec.seed));
    primes(spec, layout, zipf, &cursor, f64::from(tokens_per_s)).1
}

/// Poisson arrivals from `begin_s` to `duration_s`; each goes to a Zipf-drawn conversation's
/// next turn after `cursor` (its last turn sent), and a conversation that has sent its last
/// turn starts again from turn 1 (the same bytes: a returning user).
fn open_arrivals(
    seed: u64,
    zipf: &Zipf,
    turns: u32,
    rate_rps: f64,
    begin_s: f64,
    duration_s: f64,
    mut cursor: Vec<u32>,
) -> Vec<Arrival> {
    let mut rng = Pcg64::seed_from_u64(seed);
    let expected = rate_rps * (duration_s - begin_s).max(0.0);
    let mut out = Vec::with_capacity((expected * 1.1) as usize + 16);
    let mut t_s = begin_s;
    loop {
        t_s += exponential(&mut rng, 1.0 / rate_rps);
        if t_s >= duration_s {
            break;
        }
        let c = zipf.sample(&mut rng);
        let turn = cursor[c] + 1;
        cursor[c] = turn % turns;
        out.push(Arrival {
            at_us: (t_s * 1e6).round() as u64,
            conversation: c as u32,
            turn,
            prime: false,
        });
    }
    out
}

/// Which conversations of `spec` (drawn by `zipf`) a steady state would hold in the fleet's KV
/// cache between two of their turns: those whose share of the arrivals is at least the tokens a
/// turn adds to the cache (`user_tokens + output_tokens`) over the fleet's KV capacity. Such a
/// conversation returns, on average, before the turns of all others have added a cache's worth of
/// tokens (1 ÷ (rate × p) ≤ capacity ÷ (rate × tokens per turn); the rate cancels), so under LRU
/// its history is still there. A rarer one returns after its history was evicted in the steady
/// state too, so its first turn in a run is not an artefact of the run's start. Every
/// conversation counts when the spec is not sized against a capacity
/// ([`Sizing::Conversations`]).
pub fn steadily_cached(spec: &WorkloadSpec, zipf: &Zipf) -> Vec<bool> {
    let per_turn_tokens = f64::from(spec.user_tokens + spec.output_tokens);
    (0..zipf.len())
        .map(|c| match spec.sizing {
            Sizing::WorkingSet {
                capacity_tokens, ..
            } => zipf.pmf(c) * capacity_tokens as f64 >= per_turn_tokens,
            Sizing::Conversations(_) => true,
        })
        .collect()
}

/// Of `arrivals` (sorted) scheduled in `[from_us, to_us)`, the share that are a *cold resume*:
/// the first arrival of a conversation the steady state would hold (`counted`, from
/// [`steadily_cached`]) at a turn after the first. An open loop that starts at the steady state's
/// turn mix ([`OpenStart::Stationary`]) sends such a turn with a history no replica was ever sent,
/// so every replica prefills all of it, where the steady state would have found it cached: an
/// artefact of the run having a start, which no router can avoid and which a later window leaves
/// behind. A conversation the steady state would not hold is not counted: at a skewed point its
/// rare returns are cold whenever they come, so waiting for its first visit would only lengthen
/// the warm-up (the quick grid's ws1-s1.4 cells waited 480 s for them, 4 Dec 2026). `None` when
/// the window holds no arrival.
pub fn cold_resume_share(
    arrivals: &[Arrival],
    counted: &[bool],
    from_us: u64,
    to_us: u64,
) -> Option<f64> {
    let mut seen = vec![false; counted.len()];
    let (mut in_window, mut cold) = (0u64, 0u64);
    for a in arrivals {
        if a.at_us >= to_us {
            break;
        }
        let c = a.conversation as usize;
        let first = !std::mem::replace(&mut seen[c], true);
        if a.at_us >= from_us {
            in_window += 1;
            if first && a.turn > 1 && counted[c] {
                cold += 1;
            }
        }
    }
    (in_window > 0).then(|| cold as f64 / in_window as f64)
}

/// The warm-up an open loop of `spec` at `rate_rps` needs before a window of `measure_s` holds
/// at most `max_share` cold resumes ([`cold_resume_share`]): the primes' period
/// ([`prime_period_s`], 0 without primes) and `base_s`, the latter doubled until the window
/// holds no more, at most `max_doublings` times. The schedule alone is drawn (no texts), the same draws
/// [`Plan::build`] makes, so the plan of the chosen length has exactly these arrivals. Returns
/// the warm-up (s) and the window's share under it; the share may still exceed `max_share`
/// after the last doubling (the caller says so). Seconds are the plan's own (the rate's).
pub fn steady_state_warmup_s(
    spec: &WorkloadSpec,
    rate_rps: f64,
    start: OpenStart,
    base_s: f64,
    measure_s: f64,
    max_share: f64,
    max_doublings: u32,
) -> Result<(f64, f64), WorkloadError> {
    spec.validate()?;
    let layout = layout(spec)?;
    let zipf = Zipf::new(layout.private_tokens.len(), spec.zipf_s)?;
    let counted = steadily_cached(spec, &zipf);
    let prime_s = prime_period_with(spec, &layout, &zipf, start);
    let mut settle_s = base_s;
    let mut doublings = 0;
    loop {
        let warmup_s = prime_s + settle_s;
        let duration_s = warmup_s + measure_s;
        ArrivalSpec::Open {
            rate_rps,
            duration_s,
            start,
        }
        .validate()?;
        let arrivals = spec_arrivals(spec, &layout, &zipf, rate_rps, duration_s, start);
        let share = cold_resume_share(
            &arrivals,
            &counted,
            (warmup_s * 1e6).round() as u64,
            (duration_s * 1e6).round() as u64,
        )
        .unwrap_or(0.0);
        if share <= max_share || doublings >= max_doublings {
            return Ok((warmup_s, share));
        }
        settle_s *= 2.0;
        doublings += 1;
    }
}
