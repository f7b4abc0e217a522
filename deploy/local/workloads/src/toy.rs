//! The toy objective the parameter server trains: a sum of per-worker
//! quadratics (least squares with an identity design),
//! `f(w) = 1/W * sum_k 1/2 ||w - t_k||^2`, where worker `k`'s target
//! `t_k = w* + d_k` and the offsets `d_k` sum to zero, so the optimum is `w*`.
//! Each worker's gradient at `w` is `w - t_k` (its "data" pulls it its own
//! way); only their average points at `w*`, so a run converges only if the
//! servers really aggregate every worker's pushes.

/// The optimum's `i`-th coordinate.
pub fn optimum(i: usize) -> f32 {
    ((i % 1000) as f32) / 1000.0 - 0.5
}

/// Worker `k`'s (of `w`) offset from the optimum at coordinate `i`; the
/// offsets of all workers sum to zero.
pub fn offset(k: u32, workers: u32, i: usize) -> f32 {
    let centered = k as f32 - (workers as f32 - 1.0) / 2.0;
    let sign = if i % 2 == 0 { 1.0 } else { -1.0 };
    0.25 * centered * sign
}

/// Worker `k`'s gradient at `w` into `grad` (`w` and `grad` cover
/// coordinates `base..base+len`).
pub fn gradient(k: u32, workers: u32, base: usize, w: &[f32], grad: &mut [f32]) {
    for (j, (g, x)) in grad.iter_mut().zip(w).enumerate() {
        let i = base + j;
        *g = x - (optimum(i) + offset(k, workers, i));
    }
}

/// Mean squared distance to the optimum, halved: 0 at the solution.
pub fn loss(w: &[f32]) -> f64 {
    if w.is_empty() {
        return 0.0;
    }
    let s: f64 = w
        .iter()
        .enumerate()
        .map(|(i, x)| {
            let d = (*x - optimum(i)) as f64;
            d * d
        })
        .sum();
    0.5 * s / w.len() as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offsets_cancel() {
        for w in 1..6 {
            for i in 0..4 {
                let s: f32 = (0..w).map(|k| offset(k, w, i)).sum();
                assert!(s.abs() < 1e-6, "w={w} i={i} sum={s}");
            }
        }
    }

    #[test]
    fn averaged_gradient_points_at_optimum() {
        let w = [0.3f32; 8];
        let mut avg = [0f32; 8];
        let mut g = [0f32; 8];
        for k in 0..3 {
            gradient(k, 3, 0, &w, &mut g);
            for (a, x) in avg.iter_mut().zip(&g) {
                *a += x / 3.0;
            }
        }
        for (i, a) in avg.iter().enumerate() {
            assert!((a - (0.3 - optimum(i))).abs() < 1e-5);
        }
    }
}
