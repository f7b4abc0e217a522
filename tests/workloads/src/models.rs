//! The models of the source talk, as what matters for the network: how many
//! fp32 parameters cross it per step, and how long one step computes.
//!
//! Compute times are per step of one worker at batch 32 on a K80-class GPU
//! (the GPUs of the talk's Azure NC-series nodes), derived from the published
//! TensorFlow `tf_cnn_benchmarks` K80 figures (Inception v3 30.5 images/s,
//! ResNet-50 51.9, VGG16 35.4); GoogLeNet is not in that table and is
//! estimated from its FLOPs (1.5 GFLOPs vs ResNet-50's 4.1). They are
//! assumptions, configurable per run: what the report shows is how the
//! compute-to-communication ratio decides scaling, not GPU speed.

use serde::{Deserialize, Serialize};

/// A model as the network sees it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelProfile {
    pub name: String,
    /// fp32 parameters (= gradient values per step).
    pub params: u64,
    /// Compute time of one step (forward + backward) on one worker, seconds.
    pub compute_s: f64,
    /// Images per step per worker.
    pub batch: u32,
}

impl ModelProfile {
    /// Bytes of one full gradient (or parameter) tensor.
    pub fn tensor_bytes(&self) -> u64 {
        self.params * 4
    }

    /// The profile with tensors and compute time both multiplied by `scale`
    /// (0 < scale <= 1): the compute-to-communication ratio stays the
    /// model's, while a run takes `scale` of the time.
    pub fn scaled(&self, scale: f64) -> ModelProfile {
        ModelProfile {
            name: self.name.clone(),
            params: ((self.params as f64 * scale).round() as u64).max(1),
            compute_s: self.compute_s * scale,
            batch: self.batch,
        }
    }
}

fn profile(name: &str, params: u64, images_per_s: f64) -> ModelProfile {
    let batch = 32;
    ModelProfile {
        name: name.to_string(),
        params,
        compute_s: batch as f64 / images_per_s,
        batch,
    }
}

/// The four models of the talk, smallest first.
pub fn talk_models() -> Vec<ModelProfile> {
    vec![
        profile("googlenet", 6_800_000, 140.0),
        profile("inception3", 23_800_000, 30.5),
        profile("resnet50", 25_600_000, 51.9),
        profile("vgg16", 138_000_000, 35.4),
    ]
}

/// Looks a model up by name (case-insensitive; `inception_v3`, `resnet-50`,
/// `vgg-16` and similar spellings accepted).
pub fn by_name(name: &str) -> Option<ModelProfile> {
    let key: String = name
        .to_ascii_lowercase()
        .chars()
        .filter(|c| c.is_ascii_alphanumeric())
        .collect();
    let key = match key.as_str() {
        "inceptionv3" => "inception3",
        k => k,
    };
    talk_models().into_iter().find(|m| m.name == key)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn talk_parameter_counts() {
        let m = talk_models();
        let counts: Vec<u64> = m.iter().map(|m| m.params).collect();
        assert_eq!(counts, vec![6_800_000, 23_800_000, 25_600_000, 138_000_000]);
        assert_eq!(by_name("VGG-16").unwrap().tensor_bytes(), 552_000_000);
        assert_eq!(by_name("inception_v3").unwrap().name, "inception3");
        assert!(by_name("bert").is_none());
    }

    #[test]
    fn scaling_keeps_the_ratio() {
        let m = by_name("resnet50").unwrap();
        let s = m.scaled(1.0 / 32.0);
        let ratio = |p: &ModelProfile| p.compute_s / p.params as f64;
        assert!((ratio(&m) - ratio(&s)).abs() / ratio(&m) < 1e-6);
    }
}
