//! The models of the source talk, as what matters for the network: how many
//! fp32 parameters cross it per step, and how long one step computes on a
//! given GPU generation ([`Gpu`]).
//!
//! Compute times are per step of one worker at batch 32 (the talk's batch).
//! On the K80 (the GPUs of the talk's Azure NC-series nodes) they come from
//! the published TensorFlow `tf_cnn_benchmarks` figures for Google Compute
//! Engine K80, batch 32, synthetic data (Inception v3 30.5 images/s,
//! ResNet-50 51.9, VGG16 35.4); GoogLeNet is not in that table and is
//! estimated from its FLOPs (1.5 GFLOPs vs ResNet-50's 4.1). V100, A100 and
//! H100 times scale the K80 time of every model by ResNet-50's speed-up on
//! that GPU ([`Gpu::resnet50_images_per_s`], with its source): an
//! assumption, since only ResNet-50 has a matched published figure. They are
//! configurable per run: what the report shows is how the
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

/// K80 ResNet-50 throughput of `tf_cnn_benchmarks` (batch 32), the base the
/// other GPUs' speed-ups are taken against.
const K80_RESNET50_IMAGES_PER_S: f64 = 51.9;

/// A GPU generation: how fast a worker computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gpu {
    K80,
    V100,
    A100,
    H100,
}

impl Gpu {
    pub const ALL: [Gpu; 4] = [Gpu::K80, Gpu::V100, Gpu::A100, Gpu::H100];

    pub fn name(self) -> &'static str {
        match self {
            Gpu::K80 => "K80",
            Gpu::V100 => "V100",
            Gpu::A100 => "A100",
            Gpu::H100 => "H100",
        }
    }

    /// `k80`, `V100`, `a100`, `h100` (case-insensitive).
    pub fn parse(s: &str) -> Option<Gpu> {
        Gpu::ALL
            .into_iter()
            .find(|g| g.name().eq_ignore_ascii_case(s.trim()))
    }

    /// The numeric precision the figures are for (what people train with on
    /// that generation).
    /// The report's `gpu` field: name and precision, e.g. "A100 (mixed
    /// precision)". Reports of different labels are not merged.
    pub fn label(self) -> String {
        format!("{} ({})", self.name(), self.precision())
    }

    pub fn precision(self) -> &'static str {
        match self {
            Gpu::K80 => "FP32",
            _ => "mixed precision",
        }
    }

    /// Single-GPU ResNet-50 training throughput, images/s.
    pub fn resnet50_images_per_s(self) -> f64 {
        match self {
            Gpu::K80 => K80_RESNET50_IMAGES_PER_S,
            Gpu::V100 => 1200.0,
            Gpu::A100 => 2470.0,
            // No matched single-GPU figure in the sources used: an assumption.
            Gpu::H100 => 2.0 * 2470.0,
        }
    }

    /// Whether [`Gpu::resnet50_images_per_s`] is a published measurement
    /// (false: an assumption, labelled as such in the report).
    pub fn measured(self) -> bool {
        self != Gpu::H100
    }

    /// Where the figures come from, in words (goes into the report).
    pub fn source(self) -> &'static str {
        match self {
            Gpu::K80 => "TensorFlow tf_cnn_benchmarks (tensorflow.org performance benchmarks page, Google Compute Engine K80, batch 32, synthetic data): Inception v3 30.5 images/s, ResNet-50 51.9, VGG16 35.4; GoogLeNet (not in that table) estimated from its FLOPs (1.5 GFLOPs vs ResNet-50's 4.1): 140 images/s",
            Gpu::V100 => "NVIDIA DeepLearningExamples, PyTorch/Classification/ConvNets/resnet50v1.5/README.md, \"Training performance\" (pytorch-21.03 NGC container), 1 GPU V100 16GB: FP32 367 images/s, mixed precision 1200 images/s (used: mixed precision)",
            Gpu::A100 => "NVIDIA DeepLearningExamples, PyTorch/Classification/ConvNets/resnet50v1.5/README.md, \"Training performance\" (pytorch-21.03 NGC container), 1 GPU A100 80GB: TF32 938 images/s, mixed precision 2470 images/s (used: mixed precision)",
            Gpu::H100 => "ASSUMPTION, not a measurement: no matched single-GPU ResNet-50 figure was found in the sources used, so H100 is taken as 2x the A100 mixed-precision figure (2 x 2470 = 4940 images/s)",
        }
    }

    /// ResNet-50's speed-up over the K80 on this GPU; every model's K80
    /// compute time is divided by it (an assumption for the models other
    /// than ResNet-50).
    pub fn speedup_over_k80(self) -> f64 {
        self.resnet50_images_per_s() / K80_RESNET50_IMAGES_PER_S
    }
}

/// The four models of the talk on the talk's K80, smallest first.
pub fn talk_models() -> Vec<ModelProfile> {
    vec![
        profile("googlenet", 6_800_000, 140.0),
        profile("inception3", 23_800_000, 30.5),
        profile("resnet50", 25_600_000, 51.9),
        profile("vgg16", 138_000_000, 35.4),
    ]
}

/// The four models with the compute times of `gpu` (K80 times divided by
/// ResNet-50's speed-up over the K80 on that GPU).
pub fn models_on(gpu: Gpu) -> Vec<ModelProfile> {
    talk_models().into_iter().map(|m| m.on(gpu)).collect()
}

impl ModelProfile {
    /// This (K80) profile on another GPU generation.
    pub fn on(&self, gpu: Gpu) -> ModelProfile {
        ModelProfile {
            compute_s: self.compute_s / gpu.speedup_over_k80(),
            ..self.clone()
        }
    }
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
    fn gpu_profiles_follow_the_published_figures() {
        // ResNet-50 at batch 32: 32 / images/s of each GPU's figure.
        for (gpu, ips) in [
            (Gpu::K80, 51.9),
            (Gpu::V100, 1200.0),
            (Gpu::A100, 2470.0),
            (Gpu::H100, 4940.0),
        ] {
            let r = models_on(gpu)
                .into_iter()
                .find(|m| m.name == "resnet50")
                .unwrap();
            assert!((r.compute_s - 32.0 / ips).abs() < 1e-12, "{gpu:?}");
        }
        // Other models keep their K80 ratio to ResNet-50.
        let k80 = talk_models();
        let a100 = models_on(Gpu::A100);
        for (k, a) in k80.iter().zip(&a100) {
            assert_eq!(k.params, a.params);
            let ratio = k.compute_s / a.compute_s;
            assert!((ratio - 2470.0 / 51.9).abs() < 1e-9, "{}", k.name);
        }
        assert!(!Gpu::H100.measured() && Gpu::H100.source().starts_with("ASSUMPTION"));
        assert!(Gpu::ALL
            .iter()
            .filter(|g| **g != Gpu::H100)
            .all(|g| g.measured()));
        assert_eq!(Gpu::parse("a100"), Some(Gpu::A100));
        assert_eq!(Gpu::parse("P100"), None);
    }

    #[test]
    fn scaling_keeps_the_ratio() {
        let m = by_name("resnet50").unwrap();
        let s = m.scaled(1.0 / 32.0);
        let ratio = |p: &ModelProfile| p.compute_s / p.params as f64;
        assert!((ratio(&m) - ratio(&s)).abs() / ratio(&m) < 1e-6);
    }
}
