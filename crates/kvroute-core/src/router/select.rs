//! Picking one candidate from scores: argmin or argmax with a random tie-break, and softmax
//! sampling. Every draw comes from the router's seeded [`Rng`].

use super::rng::Rng;

/// The index of the smallest of `values` (non-empty), ties broken uniformly at random by
/// reservoir sampling. The generator is drawn from only on ties.
pub fn argmin(values: impl IntoIterator<Item = f64>, rng: &mut Rng) -> usize {
    argbest(values.into_iter().enumerate(), rng, |a, b| a < b).unwrap_or(0)
}

/// The index of the largest of `values` (non-empty), ties broken uniformly at random.
pub fn argmax(values: impl IntoIterator<Item = f64>, rng: &mut Rng) -> usize {
    argbest(values.into_iter().enumerate(), rng, |a, b| a > b).unwrap_or(0)
}

fn argbest<K>(
    values: impl IntoIterator<Item = (K, f64)>,
    rng: &mut Rng,
    better: impl Fn(f64, f64) -> bool,
) -> Option<K> {
    let mut best: Option<(K, f64)> = None;
    let mut ties = 0;
    for (key, v) in values {
        match &mut best {
            Some(b) if !better(v, b.1) => {
                if v == b.1 {
                    ties += 1;
                    if rng.below(ties) == 0 {
                        b.0 = key;
                    }
                }
            }
            _ => {
                best = Some((key, v));
                ties = 1;
            }
        }
    }
    best.map(|b| b.0)
}

/// The `rank`-th (modulo their number) of the indices whose cost is at most
/// `min + tolerance * |min|`, ordered by cost then index: replicas of different ranks that see the
/// same costs take different near-best candidates. `costs` is non-empty; `near` is scratch.
pub fn nth_near_best(costs: &[f64], tolerance: f64, rank: u32, near: &mut Vec<usize>) -> usize {
    let min = costs.iter().copied().fold(f64::INFINITY, f64::min);
    let limit = min + tolerance * min.abs();
    near.clear();
    near.extend((0..costs.len()).filter(|&i| costs[i] <= limit));
    if near.is_empty() {
        return 0;
    }
    near.sort_by(|&a, &b| costs[a].total_cmp(&costs[b]).then(a.cmp(&b)));
    near[rank as usize % near.len()]
}

/// Samples an index of `costs` (non-empty) with probability proportional to
/// `exp(-normalized / temperature)`, where `normalized = (cost - min) / (max - min)`; uniform
/// when all costs are equal (Dynamo's softmax selection). `temperature` is positive.
pub fn softmax(costs: &[f64], temperature: f64, rng: &mut Rng) -> usize {
    let (min, max) = costs
        .iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &c| {
            (lo.min(c), hi.max(c))
        });
    let span = max - min;
    if !(span > 0.0 && span.is_finite()) {
        return rng.below(costs.len());
    }
    let weight = |c: f64| (-((c - min) / span) / temperature).exp();
    let total: f64 = costs.iter().map(|&c| weight(c)).sum();
    let mut target = rng.next_f64() * total;
    for (i, &c) in costs.iter().enumerate() {
        target -= weight(c);
        if target < 0.0 {
            return i;
        }
    }
    costs.len() - 1
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn argmin_breaks_ties_evenly_and_only_among_the_best() {
        let mut rng = Rng::new(3);
        let mut counts = [0; 4];
        for _ in 0..4000 {
            counts[argmin([2.0, 1.0, 3.0, 1.0], &mut rng)] += 1;
        }
        assert_eq!(counts[0] + counts[2], 0);
        assert!(counts[1] > 1800 && counts[3] > 1800, "{counts:?}");
        assert_eq!(argmax([2.0, 1.0, 3.0, 1.0], &mut rng), 2);
    }

    #[test]
    fn nth_near_best_ranks_the_near_ties_by_cost_then_index() {
        let costs = [10.4, 10.0, 30.0, 10.0, 10.2];
        let mut near = Vec::new();
        let picks: Vec<usize> = (0..5)
            .map(|r| nth_near_best(&costs, 0.05, r, &mut near))
            .collect();
        assert_eq!(picks, [1, 3, 4, 0, 1]);
        assert_eq!(nth_near_best(&costs, 0.0, 1, &mut near), 3);
        assert_eq!(nth_near_best(&[f64::NAN], 0.1, 3, &mut near), 0);
    }

    #[test]
    fn softmax_prefers_low_costs_and_is_uniform_on_equal_ones() {
        let mut rng = Rng::new(5);
        let mut counts = [0; 3];
        for _ in 0..3000 {
            counts[softmax(&[0.0, 10.0, 10.0], 0.1, &mut rng)] += 1;
        }
        assert!(counts[0] > 2900, "{counts:?}");
        let mut counts = [0; 3];
        for _ in 0..3000 {
            counts[softmax(&[4.0, 4.0, 4.0], 1.0, &mut rng)] += 1;
        }
        assert!(counts.iter().all(|&n| n > 900), "{counts:?}");
    }
}
