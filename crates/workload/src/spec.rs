//! Workload and arrival parameters, and the names derived from them.

use serde::{Deserialize, Serialize};

use crate::WorkloadError;

/// Default turns per conversation: enough for the prefix to grow well past the first turn's.
pub const DEFAULT_TURNS: u32 = 6;
/// Default context-prefix length at turn 1, in estimated tokens (≈ the reference's unseen prompt).
pub const DEFAULT_PREFIX_TOKENS: u32 = 1_100;
/// Default user-turn length, in estimated tokens.
pub const DEFAULT_USER_TOKENS: u32 = 150;
/// Default `max_tokens` (and scripted reply length), in tokens.
pub const DEFAULT_OUTPUT_TOKENS: u32 = 128;
/// Default bytes per estimated token (what the engine emulator's tokenizer averages).
pub const DEFAULT_BYTES_PER_TOKEN: u32 = 4;
/// Most conversations a plan may hold; beyond this a plan is a mistake, not an experiment.
pub const MAX_CONVERSATIONS: u64 = 1_000_000;
/// Most requests a plan may hold.
pub const MAX_REQUESTS: u64 = 20_000_000;
/// Fewest bytes a group's shared prefix may have: room for its opening line
/// (`Group 65535 shared prefix. `, 27 bytes), which keeps two groups apart from their first
/// block on.
pub const MIN_GROUP_PREFIX_BYTES: u64 = 32;
/// Most prefix groups a workload may have: far more system prompts than any fleet's cache holds.
pub const MAX_GROUPS: u32 = 65_536;

/// Prefix groups of the grouped workload (the pressure grid's default; see the README's
/// "Prefix groups" for why): 16 groups.
pub const DEFAULT_GROUPS: u32 = 16;
/// Shared prefix of each group in the grouped workload, in estimated tokens.
pub const DEFAULT_GROUP_PREFIX_TOKENS: u32 = 2_048;
/// Zipf exponent of group membership in the grouped workload.
pub const DEFAULT_GROUP_SKEW: f64 = 1.0;
/// Private context of each conversation in the grouped workload (after its group's shared
/// prefix), in estimated tokens.
pub const DEFAULT_PRIVATE_CONTEXT_TOKENS: u32 = 512;

/// Conversations share one of `count` prefixes (a system prompt, a document, an agent's tool
/// preamble): each conversation belongs to one group, drawn deterministically from a Zipf law
/// over the groups, and its context is the group's shared prefix followed by its own private
/// context.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct PrefixGroups {
    /// Number of groups G (≥ 1).
    pub count: u32,
    /// Every group's shared prefix, in estimated tokens.
    pub prefix_tokens: u32,
    /// Zipf exponent of group membership (0 = every group equally likely), separate from the
    /// conversation skew.
    pub zipf_s: f64,
}

impl PrefixGroups {
    /// The grouped workload's groups: [`DEFAULT_GROUPS`] groups of
    /// [`DEFAULT_GROUP_PREFIX_TOKENS`] tokens, membership skew [`DEFAULT_GROUP_SKEW`].
    pub const DEFAULT: PrefixGroups = PrefixGroups {
        count: DEFAULT_GROUPS,
        prefix_tokens: DEFAULT_GROUP_PREFIX_TOKENS,
        zipf_s: DEFAULT_GROUP_SKEW,
    };

    /// `Some(groups)` for a positive count, `None` (no groups) for 0: how a `--prefix-groups 0`
    /// flag turns groups off.
    pub fn from_count(count: u32, prefix_tokens: u32, zipf_s: f64) -> Option<PrefixGroups> {
        (count > 0).then_some(PrefixGroups {
            count,
            prefix_tokens,
            zipf_s,
        })
    }
}

/// Whether several users may send turns of one conversation at the same time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum Sharing {
    /// A conversation belongs to one user at a time and its turns go one at a time
    /// (`crate::walk`).
    #[default]
    Exclusive,
    /// Any number of users may send turns of one conversation at once, and an open-loop
    /// arrival is sent at its time even while the conversation's previous turn is in flight.
    /// Scripted replies make every turn's bytes independent of what an engine generated, so
    /// nothing has to wait: hot conversations are hit by several users at the same moment.
    Shared,
}

impl Sharing {
    /// The flag / name form: `exclusive` or `shared`.
    pub fn as_str(self) -> &'static str {
        match self {
            Sharing::Exclusive => "exclusive",
            Sharing::Shared => "shared",
        }
    }

    /// Whether a conversation's turns are sent one at a time (the driver's and the
    /// simulator's per-conversation ordering, and the closed loop's ownership of a walk).
    pub fn one_turn_at_a_time(self) -> bool {
        self == Sharing::Exclusive
    }
}

impl std::str::FromStr for Sharing {
    type Err = WorkloadError;

    fn from_str(s: &str) -> Result<Self, WorkloadError> {
        match s {
            "exclusive" => Ok(Sharing::Exclusive),
            "shared" => Ok(Sharing::Shared),
            other => Err(WorkloadError::InvalidSpec(format!(
                "conversation sharing must be `exclusive` or `shared`, got `{other}`"
            ))),
        }
    }
}

/// How many conversations the workload holds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub enum Sizing {
    /// Size so that the distinct prefix tokens of all conversations at their last turn equal
    /// `ratio × capacity_tokens`.
    WorkingSet {
        /// The fleet's measured KV capacity, in tokens.
        capacity_tokens: u64,
        /// Working set ÷ capacity (0.25, 1, 3, 8, …).
        ratio: f64,
    },
    /// A fixed number of conversations with nominal lengths (no sizing).
    Conversations(u32),
}

/// What the conversations contain (everything that decides the bytes sent) and how users share
/// them.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct WorkloadSpec {
    /// Seed for every text and every draw.
    pub seed: u64,
    /// How many conversations.
    pub sizing: Sizing,
    /// Zipf exponent over conversations (0 = uniform).
    pub zipf_s: f64,
    /// Turns per conversation.
    pub turns: u32,
    /// Context prefix (system message) at turn 1, in estimated tokens; with prefix groups, the
    /// private context that follows the group's shared prefix.
    pub prefix_tokens: u32,
    /// Each user turn, in estimated tokens.
    pub user_tokens: u32,
    /// `max_tokens` of every request; the scripted assistant replies have this length too.
    pub output_tokens: u32,
    /// Bytes per estimated token; text lengths are `tokens × bytes_per_token` bytes.
    pub bytes_per_token: u32,
    /// Shared prefixes, or `None`: every conversation's context is its own.
    pub prefix_groups: Option<PrefixGroups>,
    /// Whether several users may send turns of one conversation at once.
    pub sharing: Sharing,
}

impl Default for WorkloadSpec {
    fn default() -> Self {
        Self {
            seed: 7,
            sizing: Sizing::Conversations(64),
            zipf_s: 0.0,
            turns: DEFAULT_TURNS,
            prefix_tokens: DEFAULT_PREFIX_TOKENS,
            user_tokens: DEFAULT_USER_TOKENS,
            output_tokens: DEFAULT_OUTPUT_TOKENS,
            bytes_per_token: DEFAULT_BYTES_PER_TOKEN,
            prefix_groups: None,
            sharing: Sharing::Exclusive,
        }
    }
}

/// Formats a parameter for a name: shortest decimal form (`1`, `0.25`, `1.4`).
fn num(x: f64) -> String {
    format!("{x}")
}

impl WorkloadSpec {
    /// Checks every field; the error says which one is wrong.
    pub fn validate(&self) -> Result<(), WorkloadError> {
        let bad = |m: String| Err(WorkloadError::InvalidSpec(m));
        match self.sizing {
            Sizing::WorkingSet {
                capacity_tokens,
                ratio,
            } => {
                if capacity_tokens == 0 {
                    return bad("capacity_tokens must be > 0".into());
                }
                if !ratio.is_finite() || ratio <= 0.0 {
                    return bad(format!("working-set ratio must be > 0, got {ratio}"));
                }
            }
            Sizing::Conversations(0) => return bad("conversations must be > 0".into()),
            Sizing::Conversations(n) if u64::from(n) > MAX_CONVERSATIONS => {
                return bad(format!("conversations {n} exceeds {MAX_CONVERSATIONS}"));
            }
            Sizing::Conversations(_) => {}
        }
        if !self.zipf_s.is_finite() || self.zipf_s < 0.0 {
            return bad(format!("zipf exponent must be >= 0, got {}", self.zipf_s));
        }
        if self.turns == 0 || self.turns > 1_000 {
            return bad(format!("turns must be in 1..=1000, got {}", self.turns));
        }
        if self.prefix_tokens == 0 || self.user_tokens == 0 || self.output_tokens == 0 {
            return bad("prefix, user and output tokens must be > 0".into());
        }
        if self.bytes_per_token == 0 || self.bytes_per_token > 64 {
            return bad(format!(
                "bytes_per_token must be in 1..=64, got {}",
                self.bytes_per_token
            ));
        }
        if let Some(g) = self.prefix_groups {
            if g.count == 0 || g.count > MAX_GROUPS {
                return bad(format!(
                    "prefix groups must be in 1..={MAX_GROUPS} (or none), got {}",
                    g.count
                ));
            }
            if u64::from(g.prefix_tokens) * u64::from(self.bytes_per_token) < MIN_GROUP_PREFIX_BYTES
            {
                return bad(format!(
                    "a group prefix must hold at least {MIN_GROUP_PREFIX_BYTES} bytes (its \
                     opening line names the group), got {} tokens × {} bytes",
                    g.prefix_tokens, self.bytes_per_token
                ));
            }
            if !g.zipf_s.is_finite() || g.zipf_s < 0.0 {
                return bad(format!("group skew must be >= 0, got {}", g.zipf_s));
            }
        }
        Ok(())
    }

    /// Estimated tokens of one group's shared prefix (0 without groups).
    pub fn group_prefix_tokens(&self) -> u64 {
        self.prefix_groups.map_or(0, |g| u64::from(g.prefix_tokens))
    }

    /// Estimated tokens of turn `turn`'s prompt (1-based) of a conversation whose context at
    /// turn 1 is `context_tokens` (with prefix groups: the group's shared prefix and the private
    /// context): the context, every earlier user turn and reply, and this turn's user message.
    pub fn turn_tokens(&self, context_tokens: u64, turn: u32) -> u64 {
        let earlier = u64::from(turn.saturating_sub(1));
        context_tokens
            + earlier * u64::from(self.user_tokens + self.output_tokens)
            + u64::from(self.user_tokens)
    }

    /// Estimated tokens of one conversation's last-turn prompt with a context prefix of
    /// `prefix_tokens`: the prefix, every user turn and every reply but the last. With prefix
    /// groups `prefix_tokens` is the private context and the group's shared prefix is not
    /// counted (the working set counts it once per group, not per conversation).
    pub fn last_turn_tokens(&self, prefix_tokens: u64) -> u64 {
        let turns = u64::from(self.turns);
        prefix_tokens
            + turns * u64::from(self.user_tokens)
            + (turns - 1) * u64::from(self.output_tokens)
    }

    /// Human-readable name of the content, e.g. `chat-ws1-cap200000-s0-t6-p1100-u150-o128-seed7`;
    /// with prefix groups `-g{count}-gp{prefix_tokens}-gs{skew}` and with shared conversations
    /// `-shared` come before the seed (absent otherwise, so a workload without them keeps its
    /// old name). Any parameter change changes the name.
    pub fn name(&self) -> String {
        let size = match self.sizing {
            Sizing::WorkingSet {
                capacity_tokens,
                ratio,
            } => format!("ws{}-cap{capacity_tokens}", num(ratio)),
            Sizing::Conversations(n) => format!("n{n}"),
        };
        let bpt = if self.bytes_per_token == DEFAULT_BYTES_PER_TOKEN {
            String::new()
        } else {
            format!("-bpt{}", self.bytes_per_token)
        };
        let groups = self.prefix_groups.map_or(String::new(), |g| {
            format!("-g{}-gp{}-gs{}", g.count, g.prefix_tokens, num(g.zipf_s))
        });
        let sharing = match self.sharing {
            Sharing::Exclusive => "",
            Sharing::Shared => "-shared",
        };
        format!(
            "chat-{size}-s{}-t{}-p{}-u{}-o{}{bpt}{groups}{sharing}-seed{}",
            num(self.zipf_s),
            self.turns,
            self.prefix_tokens,
            self.user_tokens,
            self.output_tokens,
            self.seed
        )
    }
}

/// How requests arrive.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub enum ArrivalSpec {
    /// `users` users; each thinks (exponential, mean `think_mean_s`), sends a turn, waits for the
    /// whole reply, and repeats, working through Zipf-drawn conversations turn by turn.
    Closed {
        /// Concurrent users.
        users: u32,
        /// Mean think time before each request, in seconds (0 = none).
        think_mean_s: f64,
        /// Requests each user sends before stopping.
        requests_per_user: u32,
    },
    /// Poisson arrivals at `rate_rps` for `duration_s`; each arrival is the next turn of a
    /// Zipf-drawn conversation.
    Open {
        /// Mean arrival rate, requests per second.
        rate_rps: f64,
        /// Length of the schedule, in seconds.
        duration_s: f64,
        /// Which turn each conversation's first arrival sends.
        #[serde(default)]
        start: OpenStart,
    },
}

/// Where an open loop's conversations stand when the schedule begins.
///
/// With [`OpenStart::Fresh`] every conversation starts at turn 1, so the schedule's first
/// minutes send short prompts and the turn mix drifts towards its steady state for as long as it
/// takes the Zipf draws to visit each conversation a few times: at a working set of 8× the full
/// fleet's KV capacity, skew 0, 32 req/s, the mean turn rose from 1.2 to its steady 3.5 over
/// about 270 s and the mean prompt by 26% (virtual, 1 Dec 2026), so no practical warm-up covered
/// it. [`OpenStart::Stationary`] starts each conversation at a turn drawn uniformly (from its own
/// seeded stream), which is the steady state's turn mix: a conversation at turn `k` after `n`
/// visits stands at `(k + n) mod turns`, uniform whenever `k` is, whatever the skew. What stays
/// is the caches' own warm-up, which a cell's warm-up covers.
///
/// That warm-up is long when the caches turn over slowly: a conversation whose first visit in
/// the run resumes it past turn 1 finds its history nowhere, where the steady state would have
/// found it cached (a *cold resume*, `crate::cold_resume_share`), and waiting until every such
/// conversation has been visited once took up to 8 minutes of a quick-grid cell (4 Dec 2026).
/// [`OpenStart::Primed`] sends those histories first, at a stated pace, so the caches hold what
/// the steady state would hold before the Poisson arrivals begin.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum OpenStart {
    /// Every conversation at turn 1 (the arrival name has no suffix).
    #[default]
    Fresh,
    /// Every conversation at a uniformly drawn turn (the arrival name ends `-steady`).
    Stationary,
    /// As [`OpenStart::Stationary`], and first a *priming* send for every conversation the
    /// steady state would hold in the cache (`crate::steadily_cached`) whose first turn is past
    /// turn 1: its previous turn, sent with `max_tokens` 1 (prefill only), so that the cache
    /// holds the history the first turn resumes. The primes go in a seeded random order (in the
    /// steady state a conversation's last visit says nothing about its next), each at the time
    /// the prompt tokens of the primes before it take at `tokens_per_s`; the Poisson arrivals
    /// begin when the last prime's share of that time is over (`crate::prime_period_s`). The
    /// arrival name ends `-primed<tokens_per_s>`.
    Primed {
        /// The pace of the primes, prompt tokens per second (of the plan's clock).
        tokens_per_s: u32,
    },
}

impl ArrivalSpec {
    /// Checks every field; the error says which one is wrong.
    pub fn validate(&self) -> Result<(), WorkloadError> {
        let bad = |m: String| Err(WorkloadError::InvalidSpec(m));
        match *self {
            ArrivalSpec::Closed {
                users,
                think_mean_s,
                requests_per_user,
            } => {
                if users == 0 || requests_per_user == 0 {
                    return bad("users and requests_per_user must be > 0".into());
                }
                if !think_mean_s.is_finite() || think_mean_s < 0.0 {
                    return bad(format!("think_mean_s must be >= 0, got {think_mean_s}"));
                }
                if u64::from(users) * u64::from(requests_per_user) > MAX_REQUESTS {
                    return bad(format!("users × requests_per_user exceeds {MAX_REQUESTS}"));
                }
            }
            ArrivalSpec::Open {
                rate_rps,
                duration_s,
                start,
            } => {
                if let OpenStart::Primed { tokens_per_s: 0 } = start {
                    return bad("the primes' pace must be > 0 tokens/s".into());
                }
                if !rate_rps.is_finite() || rate_rps <= 0.0 {
                    return bad(format!("rate must be > 0 req/s, got {rate_rps}"));
                }
                if !duration_s.is_finite() || duration_s <= 0.0 {
                    return bad(format!("duration must be > 0 s, got {duration_s}"));
                }
                if rate_rps * duration_s > MAX_REQUESTS as f64 {
                    return bad(format!("rate × duration exceeds {MAX_REQUESTS} requests"));
                }
            }
        }
        Ok(())
    }

    /// Name of the arrival process, e.g. `closed-u32-th1-r24`, `open-l5-d120` or
    /// `open-l5-d120-steady` (a [`OpenStart::Stationary`] start).
    pub fn name(&self) -> String {
        match *self {
            ArrivalSpec::Closed {
                users,
                think_mean_s,
                requests_per_user,
            } => format!(
                "closed-u{users}-th{}-r{requests_per_user}",
                num(think_mean_s)
            ),
            ArrivalSpec::Open {
                rate_rps,
                duration_s,
                start,
            } => format!(
                "open-l{}-d{}{}",
                num(rate_rps),
                num(duration_s),
                match start {
                    OpenStart::Fresh => String::new(),
                    OpenStart::Stationary => "-steady".to_owned(),
                    OpenStart::Primed { tokens_per_s } => format!("-primed{tokens_per_s}"),
                }
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_name_matches_documented_form() {
        assert_eq!(
            WorkloadSpec::default().name(),
            "chat-n64-s0-t6-p1100-u150-o128-seed7"
        );
        let ws = WorkloadSpec {
            sizing: Sizing::WorkingSet {
                capacity_tokens: 200_000,
                ratio: 0.25,
            },
            zipf_s: 1.4,
            ..WorkloadSpec::default()
        };
        assert_eq!(
            ws.name(),
            "chat-ws0.25-cap200000-s1.4-t6-p1100-u150-o128-seed7"
        );
        let grouped = WorkloadSpec {
            prefix_groups: Some(PrefixGroups::DEFAULT),
            prefix_tokens: DEFAULT_PRIVATE_CONTEXT_TOKENS,
            sharing: Sharing::Shared,
            ..ws
        };
        assert_eq!(
            grouped.name(),
            "chat-ws0.25-cap200000-s1.4-t6-p512-u150-o128-g16-gp2048-gs1-shared-seed7"
        );
    }

    #[test]
    fn validation_names_the_field() {
        let s = WorkloadSpec {
            turns: 0,
            ..WorkloadSpec::default()
        };
        let e = s.validate().unwrap_err().to_string();
        assert!(e.contains("turns"), "{e}");
        let g = WorkloadSpec {
            prefix_groups: Some(PrefixGroups {
                zipf_s: -1.0,
                ..PrefixGroups::DEFAULT
            }),
            ..WorkloadSpec::default()
        };
        let e = g.validate().unwrap_err().to_string();
        assert!(e.contains("group skew"), "{e}");
        assert!("both".parse::<Sharing>().is_err());
        assert_eq!("shared".parse::<Sharing>(), Ok(Sharing::Shared));
        let a = ArrivalSpec::Open {
            rate_rps: -1.0,
            duration_s: 1.0,
            start: OpenStart::Fresh,
        };
        assert!(a.validate().unwrap_err().to_string().contains("rate"));
    }
}
