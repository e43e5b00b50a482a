//! The schedule of the pair communicators' creation (`p2p_split_rounds`): a pure function
//! of the host layout, tested without a GPU.

/// The rounds of ncclCommSplit that create the point-to-point communicators of a group:
/// one 2-rank communicator per ordered pair (sender, receiver) that needs one, carrying
/// only the sender's messages to the receiver. `hosts` lists each host's group ranks;
/// pairs of ranks on different hosts always need one, pairs on one host only when
/// `same_host` (the group has no rsccl engine inside the host to carry them).
///
/// Each round is a list of disjoint ordered pairs (every rank in at most one: a split
/// gives a rank one color), and every needed ordered pair is in exactly one round. A pure
/// function of the layout, so every rank computes the same schedule and makes the same
/// collective split calls. Each round costs one split over the whole group, so fewer is
/// faster: the unordered pairs are edge-coloured greedily (each round a matching that
/// serves the ranks with the most pairs left first), retried with a few fixed tie-break
/// orders on groups of up to 128 ranks, keeping the fewest matchings (stopping at the
/// lower bound, the most pairs of one rank); each matching gives two rounds, one per
/// direction.
pub fn p2p_split_rounds(hosts: &[Vec<usize>], same_host: bool) -> Vec<Vec<(usize, usize)>> {
    let n = hosts.iter().flatten().map(|&r| r + 1).max().unwrap_or(0);
    let mut host_of = vec![usize::MAX; n];
    for (h, ranks) in hosts.iter().enumerate() {
        for &r in ranks {
            host_of[r] = h;
        }
    }
    let needs =
        |a: usize, b: usize| a != b && host_of[a] != usize::MAX && host_of[b] != usize::MAX && (host_of[a] != host_of[b] || same_host);
    let bound = (0..n).map(|a| (0..n).filter(|&b| needs(a, b)).count()).max().unwrap_or(0);
    let tries = if n <= 128 { 16 } else { 1 };
    let mut best: Option<Vec<Vec<(usize, usize)>>> = None;
    for t in 0..tries {
        // A fixed permutation of the ranks for ties: multiplier coprime with n (or 1).
        let mult = [1, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59][t];
        let mult = if gcd(mult, n.max(1)) == 1 { mult } else { 1 };
        let tie: Vec<usize> = (0..n).map(|r| (r * mult + t) % n.max(1)).collect();
        let m = greedy_matchings(n, &needs, &tie);
        if best.as_ref().is_none_or(|b| m.len() < b.len()) {
            best = Some(m);
        }
        if best.as_ref().is_some_and(|b| b.len() <= bound) {
            break;
        }
    }
    // The round-robin tournament (circle method), filtered: at most n matchings whatever
    // the layout, where the greedy colouring can take more (a complete graph).
    let circle = circle_matchings(n, &needs);
    if best.as_ref().is_none_or(|b| circle.len() < b.len()) {
        best = Some(circle);
    }
    let mut rounds = Vec::new();
    for mut matching in best.unwrap_or_default() {
        matching.sort_unstable();
        rounds.push(matching.clone());
        rounds.push(matching.into_iter().map(|(a, b)| (b, a)).collect());
    }
    rounds
}

/// The circle method's n - 1 (n even) or n (n odd) perfect matchings of the complete
/// graph, keeping the pairs `needs` asks for, without the empty ones.
fn circle_matchings(n: usize, needs: &dyn Fn(usize, usize) -> bool) -> Vec<Vec<(usize, usize)>> {
    let m = n + n % 2; // a dummy rank (n) when n is odd
    let mut out = Vec::new();
    for k in 0..m.saturating_sub(1) {
        let mut matching = Vec::new();
        let mut pair = |a: usize, b: usize| {
            if a < n && b < n && needs(a, b) {
                matching.push((a.min(b), a.max(b)));
            }
        };
        pair(k, m - 1);
        for i in 1..m / 2 {
            pair((k + i) % (m - 1), (k + m - 1 - i) % (m - 1));
        }
        if !matching.is_empty() {
            out.push(matching);
        }
    }
    out
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// Matchings that together cover every unordered pair {a, b} with `needs(a, b)` once:
/// each takes the ranks with the most pairs left first, each matched to the free partner
/// with the most pairs left; `tie` orders equals.
fn greedy_matchings(n: usize, needs: &dyn Fn(usize, usize) -> bool, tie: &[usize]) -> Vec<Vec<(usize, usize)>> {
    let mut need: Vec<Vec<bool>> = (0..n).map(|a| (0..n).map(|b| needs(a, b)).collect()).collect();
    let mut left: Vec<usize> = need.iter().map(|row| row.iter().filter(|&&x| x).count()).collect();
    let mut out = Vec::new();
    while left.iter().any(|&l| l > 0) {
        let mut order: Vec<usize> = (0..n).filter(|&r| left[r] > 0).collect();
        order.sort_by_key(|&r| (std::cmp::Reverse(left[r]), tie[r]));
        let mut busy = vec![false; n];
        let mut matching = Vec::new();
        for &a in &order {
            if busy[a] {
                continue;
            }
            let partner = (0..n).filter(|&b| need[a][b] && !busy[b]).max_by_key(|&b| (left[b], std::cmp::Reverse(tie[b])));
            if let Some(b) = partner {
                busy[a] = true;
                busy[b] = true;
                matching.push((a.min(b), a.max(b)));
            }
        }
        for &(a, b) in &matching {
            need[a][b] = false;
            need[b][a] = false;
            left[a] -= 1;
            left[b] -= 1;
        }
        out.push(matching);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Check a schedule against its rules and return its number of rounds.
    fn check_rounds(hosts: &[Vec<usize>], same_host: bool) -> usize {
        let rounds = p2p_split_rounds(hosts, same_host);
        let host_of = |r: usize| hosts.iter().position(|h| h.contains(&r)).expect("a member");
        let members: Vec<usize> = hosts.iter().flatten().copied().collect();
        let mut seen = std::collections::HashSet::new();
        for (i, round) in rounds.iter().enumerate() {
            let mut in_round = std::collections::HashSet::new();
            assert!(!round.is_empty(), "{hosts:?}: round {i} is empty");
            for &(s, r) in round {
                assert!(s != r, "{hosts:?}: round {i} pairs rank {s} with itself");
                assert!(members.contains(&s) && members.contains(&r), "{hosts:?}: round {i}: ({s}, {r}) not in the group");
                assert!(same_host || host_of(s) != host_of(r), "{hosts:?}: round {i}: ({s}, {r}) on one host got a communicator");
                assert!(in_round.insert(s) && in_round.insert(r), "{hosts:?}: round {i} has rank {s} or {r} twice");
                assert!(seen.insert((s, r)), "{hosts:?}: ({s}, {r}) in two rounds");
            }
        }
        for &s in &members {
            for &r in &members {
                let needed = s != r && (same_host || host_of(s) != host_of(r));
                assert_eq!(seen.contains(&(s, r)), needed, "{hosts:?}: ordered pair ({s}, {r})");
            }
        }
        rounds.len()
    }

    /// Host-major layout: `sizes[h]` consecutive ranks on host h.
    fn layout(sizes: &[usize]) -> Vec<Vec<usize>> {
        let mut next = 0;
        sizes
            .iter()
            .map(|&k| {
                (0..k)
                    .map(|_| {
                        next += 1;
                        next - 1
                    })
                    .collect()
            })
            .collect()
    }

    #[test]
    fn p2p_rounds_cover_every_ordered_cross_host_pair_once() {
        // (layout, the lower bound: twice the most cross-host peers of one rank)
        for (sizes, best) in [
            (vec![2, 2], 4),
            (vec![4, 4], 8),
            (vec![1, 3], 6),
            (vec![2, 2, 2], 8),
            (vec![8, 8], 16),
            (vec![1, 1], 2),
            (vec![3, 1, 2], 10),
            (vec![4, 4, 4, 4], 24),
        ] {
            let rounds = check_rounds(&layout(&sizes), false);
            assert!(rounds >= best, "{sizes:?}: {rounds} rounds under the lower bound {best}?");
            // Greedy colouring: at most two rounds over the bound (one more matching).
            assert!(rounds <= best + 2, "{sizes:?}: {rounds} rounds, the lower bound is {best}");
        }
        // The layouts the GPU tests and a 2 x 8 cluster use reach the bound.
        assert_eq!(check_rounds(&layout(&[2, 2]), false), 4);
        assert_eq!(check_rounds(&layout(&[8, 8]), false), 16);
        // Not host-major (hosts take turns): same rules.
        check_rounds(&[vec![0, 2], vec![1, 3]], false);
        check_rounds(&[vec![0, 3, 4], vec![1], vec![2, 5]], false);
        // One host: nothing to create unless same-host pairs need NCCL too.
        assert_eq!(p2p_split_rounds(&layout(&[4]), false), Vec::<Vec<(usize, usize)>>::new());
        assert_eq!(p2p_split_rounds(&[], false), Vec::<Vec<(usize, usize)>>::new());
    }

    #[test]
    fn p2p_rounds_include_same_host_pairs_when_asked() {
        // Hosts with unequal GPUs have no rsccl engine inside the host: NCCL carries those too.
        for sizes in [vec![1, 3], vec![2, 3], vec![3, 1, 2], vec![4]] {
            let rounds = check_rounds(&layout(&sizes), true);
            let n: usize = sizes.iter().sum();
            assert!(rounds <= 2 * n, "{sizes:?}: {rounds} rounds for {n} ranks (the circle method needs at most n matchings)");
        }
    }

    #[test]
    fn p2p_rounds_exhaustive_over_small_layouts() {
        // Every split of up to 7 ranks into up to 4 hosts, host-major, both modes.
        fn compositions(n: usize, parts: usize) -> Vec<Vec<usize>> {
            if parts == 1 {
                return vec![vec![n]];
            }
            (1..=n - (parts - 1))
                .flat_map(|first| {
                    compositions(n - first, parts - 1).into_iter().map(move |mut rest| {
                        rest.insert(0, first);
                        rest
                    })
                })
                .collect()
        }
        for n in 1..=7 {
            for parts in 1..=n.min(4) {
                for sizes in compositions(n, parts) {
                    check_rounds(&layout(&sizes), false);
                    check_rounds(&layout(&sizes), true);
                }
            }
        }
    }
}
