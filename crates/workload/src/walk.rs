//! Closed-loop walk selection: which conversation a user takes up next.
//!
//! A closed-loop script is a sequence of walks: a drawn conversation followed through turns
//! 1..T. A conversation belongs to one user at a time, from the decision to start its walk
//! (before turn 1's think time) until the walk's last response ends. When a user's next draw
//! is owned by another user, queueing behind it would convoy every user onto the hottest
//! conversations (an artifact of the replay, not a property of chat traffic), so the user skips
//! that draw and takes the next one from its own pre-drawn sequence: the script's walk draws
//! followed by the plan's spare draws (`Schedule::Closed::spare_draws`). It looks at most
//! [`SKIP_WINDOW_DRAWS`] draws ahead; the first free one is taken and the owned ones before it
//! are dropped (each counts as a skip). If every draw in the window is owned, the user waits
//! for the first one (FIFO among waiters), as a user without the skip rule would.
//!
//! The walk structure (how many turns each walk has, each slot's think time and request index)
//! is the script's; only the conversation of a walk can change. Without collisions a user
//! sends exactly its script. The live driver and the simulator both drive a [`WalkCursor`] per
//! user, so they apply the identical rule; only what "claim" means (a lock, or a table entry)
//! differs.
//!
//! With [`Sharing::Shared`] nobody owns a conversation: a cursor takes each walk's draw as it
//! comes, never asks to claim it, never skips and never waits, so several users may send turns
//! of one conversation at the same moment — the script is sent exactly as drawn.

use std::collections::VecDeque;

use crate::plan::Step;
use crate::spec::Sharing;

/// How many draws a user looks at before it waits: the current one plus up to 31 later ones.
/// A walk start consumes at most this many draws. Sized for skew: at s = 1.4 the users can own
/// most of the probability mass, and with a window of 8 about 0.9^8 ≈ 40 % of walk starts
/// found every draw owned and waited on the hottest conversation, which re-formed the convoy
/// (the quick virtual sweep still set aside 7 of 36 cells); with 32 such waits are rare
/// (0.9^32 ≈ 3 %).
pub const SKIP_WINDOW_DRAWS: usize = 32;

/// One walk: consecutive steps of a user's script through one conversation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Walk {
    /// Conversation index.
    pub conversation: u32,
    /// Script index of the walk's first step.
    pub first_step: usize,
    /// Steps in the walk (the script's last walk may be cut short).
    pub steps: usize,
}

/// Splits a script into walks: a new walk begins where the conversation changes or the turn
/// does not follow the previous one.
pub fn walks(script: &[Step]) -> Vec<Walk> {
    let mut out: Vec<Walk> = Vec::new();
    for (i, s) in script.iter().enumerate() {
        match out.last_mut() {
            Some(w)
                if w.conversation == s.conversation
                    && script[i - 1].turn.checked_add(1) == Some(s.turn) =>
            {
                w.steps += 1;
            }
            _ => out.push(Walk {
                conversation: s.conversation,
                first_step: i,
                steps: 1,
            }),
        }
    }
    out
}

/// What a user does next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pick {
    /// Send script slot `step` (its think time, its turn and request index) to `conversation`,
    /// which the user owns.
    Step {
        /// Script index of the slot.
        step: usize,
        /// The conversation of the walk in progress.
        conversation: u32,
        /// Whether this is the walk's last step: the conversation is released when its
        /// response ends.
        ends_walk: bool,
    },
    /// Every draw in the window is owned by another user: wait until `conversation` is handed
    /// over, then call [`WalkCursor::start_waited`]. `step` is the slot that will be sent (its
    /// think time runs while waiting).
    Wait {
        /// The conversation waited for.
        conversation: u32,
        /// Script index of the walk's first slot.
        step: usize,
    },
    /// The script is finished.
    Done,
}

/// One user's position in its script under the skip rule (see the module docs).
#[derive(Debug, Clone)]
pub struct WalkCursor {
    walks: Vec<Walk>,
    /// Draws not yet consumed: the script's walk conversations, then the spare draws.
    draws: VecDeque<u32>,
    /// Index of the next walk to start.
    next_walk: usize,
    /// The walk in progress, the offset of its next step, and its conversation.
    current: Option<(usize, usize, u32)>,
    /// The conversation of the last [`Pick::Wait`].
    waiting: Option<u32>,
    skipped: u64,
    waits: u64,
    sharing: Sharing,
}

impl WalkCursor {
    /// A cursor at the start of `script`, with `spare` draws to skip to after the script's
    /// own, under the workload's `sharing` rule.
    pub fn new(script: &[Step], spare: &[u32], sharing: Sharing) -> Self {
        let walks = walks(script);
        let draws = walks
            .iter()
            .map(|w| w.conversation)
            .chain(spare.iter().copied())
            .collect();
        WalkCursor {
            walks,
            draws,
            next_walk: 0,
            current: None,
            waiting: None,
            skipped: 0,
            waits: 0,
            sharing,
        }
    }

    /// Whether this cursor claims conversations (exclusive sharing): only then does a
    /// [`Pick::Step`] mean the user owns the conversation until its walk ends.
    pub fn claims(&self) -> bool {
        self.sharing.one_turn_at_a_time()
    }

    /// The next step. Mid-walk it is the walk's next turn. At a walk start, `try_claim(c)` is
    /// called for the draws of the window in order until one succeeds (it must make the user
    /// the owner of `c` when it returns true); the owned draws before it are dropped and count
    /// as skips. If none succeeds the answer is [`Pick::Wait`] for the first draw. With shared
    /// conversations `try_claim` is never called: the walk takes its draw.
    pub fn next(&mut self, mut try_claim: impl FnMut(u32) -> bool) -> Pick {
        if let Some(pick) = self.continue_walk() {
            return pick;
        }
        if self.next_walk >= self.walks.len() {
            return Pick::Done;
        }
        if !self.claims() {
            return match self.draws.pop_front() {
                Some(c) => self.begin(c),
                None => Pick::Done,
            };
        }
        let window = self.draws.len().min(SKIP_WINDOW_DRAWS);
        for i in 0..window {
            let c = self.draws[i];
            if try_claim(c) {
                self.skipped += i as u64;
                self.draws.drain(..=i);
                return self.begin(c);
            }
        }
        match self.draws.front() {
            Some(&c) => {
                self.waits += 1;
                self.waiting = Some(c);
                Pick::Wait {
                    conversation: c,
                    step: self.walks[self.next_walk].first_step,
                }
            }
            None => Pick::Done,
        }
    }

    /// After a [`Pick::Wait`], once the user owns the conversation: starts that walk and
    /// returns its first step ([`Pick::Done`] if there was no wait).
    pub fn start_waited(&mut self) -> Pick {
        let Some(c) = self.waiting.take() else {
            return Pick::Done;
        };
        self.draws.pop_front();
        self.begin(c)
    }

    /// Draws dropped because another user owned them.
    pub fn skipped(&self) -> u64 {
        self.skipped
    }

    /// Walk starts where the whole window was owned and the user waited.
    pub fn waits(&self) -> u64 {
        self.waits
    }

    fn begin(&mut self, conversation: u32) -> Pick {
        self.current = Some((self.next_walk, 0, conversation));
        self.next_walk += 1;
        self.continue_walk().unwrap_or(Pick::Done)
    }

    fn continue_walk(&mut self) -> Option<Pick> {
        let (w, off, conversation) = self.current?;
        let walk = self.walks.get(w)?;
        if off >= walk.steps {
            self.current = None;
            return None;
        }
        let ends_walk = off + 1 == walk.steps;
        self.current = if ends_walk {
            None
        } else {
            Some((w, off + 1, conversation))
        };
        Some(Pick::Step {
            step: walk.first_step + off,
            conversation,
            ends_walk,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn script(convs: &[(u32, u32)]) -> Vec<Step> {
        convs
            .iter()
            .flat_map(|&(c, turns)| {
                (1..=turns).map(move |turn| Step {
                    conversation: c,
                    turn,
                    think_us: 0,
                })
            })
            .collect()
    }

    #[test]
    fn walks_split_on_conversation_and_turn_restart() {
        let s = script(&[(3, 2), (3, 2), (5, 1)]);
        let w = walks(&s);
        assert_eq!(
            w,
            [
                Walk {
                    conversation: 3,
                    first_step: 0,
                    steps: 2
                },
                Walk {
                    conversation: 3,
                    first_step: 2,
                    steps: 2
                },
                Walk {
                    conversation: 5,
                    first_step: 4,
                    steps: 1
                },
            ]
        );
    }

    #[test]
    fn free_draws_follow_the_script() {
        let s = script(&[(1, 2), (2, 1)]);
        let mut c = WalkCursor::new(&s, &[9, 9], Sharing::Exclusive);
        let mut order = Vec::new();
        loop {
            match c.next(|_| true) {
                Pick::Step {
                    step,
                    conversation,
                    ends_walk,
                } => order.push((step, conversation, ends_walk)),
                Pick::Wait { .. } => panic!("nothing is owned"),
                Pick::Done => break,
            }
        }
        assert_eq!(order, [(0, 1, false), (1, 1, true), (2, 2, true)]);
        assert_eq!(c.skipped(), 0);
    }

    #[test]
    fn an_owned_draw_is_dropped_for_the_next_one() {
        let s = script(&[(7, 2), (8, 1)]);
        let mut c = WalkCursor::new(&s, &[5, 6], Sharing::Exclusive);
        // 7 is owned elsewhere: the first walk (two slots) goes to 8, the next draw.
        let step = |step, conversation, ends_walk| Pick::Step {
            step,
            conversation,
            ends_walk,
        };
        assert_eq!(c.next(|conv| conv != 7), step(0, 8, false));
        assert_eq!(c.skipped(), 1);
        assert_eq!(c.next(|_| panic!("mid-walk")), step(1, 8, true));
        // The second walk takes the first spare draw; 7 is gone.
        assert_eq!(c.next(|_| true), step(2, 5, true));
        assert_eq!(c.next(|_| true), Pick::Done);
        assert_eq!(c.skipped(), 1);
    }

    #[test]
    fn an_owned_window_waits_for_the_first_draw() {
        let s = script(&[(0, 1), (1, 1)]);
        let spare: Vec<u32> = (2..2 + SKIP_WINDOW_DRAWS as u32).collect();
        let mut c = WalkCursor::new(&s, &spare, Sharing::Exclusive);
        let mut asked = Vec::new();
        let pick = c.next(|conv| {
            asked.push(conv);
            false
        });
        // Only the window is asked; the draws beyond it are not.
        assert_eq!(asked.len(), SKIP_WINDOW_DRAWS);
        assert_eq!(
            pick,
            Pick::Wait {
                conversation: 0,
                step: 0
            }
        );
        assert_eq!((c.waits(), c.skipped()), (1, 0));
        assert_eq!(
            c.start_waited(),
            Pick::Step {
                step: 0,
                conversation: 0,
                ends_walk: true
            }
        );
        assert_eq!(c.start_waited(), Pick::Done);
        // The draws after the waited one are still there.
        assert!(matches!(
            c.next(|_| true),
            Pick::Step {
                conversation: 1,
                ..
            }
        ));
    }

    /// Two users whose scripts both start with conversation 0, claiming through one owner
    /// table as the driver (a mutex per conversation) and the simulator (an owner per
    /// conversation) do: exclusive, the second user skips to its next draw; shared, both hold
    /// conversation 0 at once and nobody skips or waits.
    #[test]
    fn shared_conversations_are_held_by_two_users_at_once() {
        let s = script(&[(0, 2), (1, 1)]);
        let walk_start = |sharing| {
            let mut owner: Vec<Option<usize>> = vec![None; 2];
            let mut cursors = [
                WalkCursor::new(&s, &[], sharing),
                WalkCursor::new(&s, &[], sharing),
            ];
            let picks: Vec<Pick> = cursors
                .iter_mut()
                .enumerate()
                .map(|(user, cursor)| {
                    cursor.next(|c| match &mut owner[c as usize] {
                        o @ None => {
                            *o = Some(user);
                            true
                        }
                        Some(_) => false,
                    })
                })
                .collect();
            let skipped: u64 = cursors.iter().map(WalkCursor::skipped).sum();
            (picks, skipped, owner)
        };
        let (picks, skipped, owner) = walk_start(Sharing::Exclusive);
        assert_eq!(
            picks,
            [
                Pick::Step {
                    step: 0,
                    conversation: 0,
                    ends_walk: false
                },
                Pick::Step {
                    step: 0,
                    conversation: 1,
                    ends_walk: false
                },
            ]
        );
        assert_eq!((skipped, owner), (1, vec![Some(0), Some(1)]));
        let (picks, skipped, owner) = walk_start(Sharing::Shared);
        let both_on_zero = Pick::Step {
            step: 0,
            conversation: 0,
            ends_walk: false,
        };
        assert_eq!(picks, [both_on_zero, both_on_zero]);
        assert_eq!((skipped, owner), (0, vec![None, None]));
    }

    #[test]
    fn a_shared_cursor_sends_its_script_as_drawn() {
        let s = script(&[(4, 2), (4, 1), (2, 1)]);
        let mut c = WalkCursor::new(&s, &[], Sharing::Shared);
        assert!(!c.claims());
        let mut sent = Vec::new();
        loop {
            match c.next(|_| panic!("a shared cursor never claims")) {
                Pick::Step {
                    step, conversation, ..
                } => sent.push((step, conversation)),
                Pick::Wait { .. } => panic!("a shared cursor never waits"),
                Pick::Done => break,
            }
        }
        assert_eq!(sent, [(0, 4), (1, 4), (2, 4), (3, 2)]);
        assert_eq!((c.skipped(), c.waits()), (0, 0));
    }
}
