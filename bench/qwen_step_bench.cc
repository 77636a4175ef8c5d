// Forward+backward time of the Qwen3.5-0.8B text model on one GPU (BF16, batch 1,
// sequence 2048) for the `none` and `gate` pre-GDR fusion levels: warm-up, then the
// median of timed iterations (CUDA events); prints ms per step and tokens/s.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <vector>

#include "models/qwen/config.h"
#include "models/qwen/model.h"

int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], "--help") == 0) {
    std::printf(
        "usage: qwen_step_bench\n  Times forward+backward of configs/qwen3_5_0_8b.yaml in BF16 at\n"
        "  batch 1 x sequence 2048 for pre_gdr_fusion none and gate.\n");
    return 0;
  }
  auto config = gdr::load_qwen_config("configs/qwen3_5_0_8b.yaml");
  if (!config.ok()) {
    std::fprintf(stderr, "qwen_step_bench: %s\n", std::string(config.status().message()).c_str());
    return 2;
  }
  gdr::QwenForCausalLM model(*config);
  gdr::init_qwen_weights(*model, 1);
  model->to(at::kCUDA, at::kBFloat16);
  const int64_t seq = 2048;
  const at::Tensor ids = at::randint(0, config->vocab_size, {1, seq},
                                     at::TensorOptions().device(at::kCUDA).dtype(at::kLong));
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  std::printf("| fusion | fwd+bwd ms (median of 5) | tokens/s |\n|---|---|---|\n");
  for (auto fusion : {gdr::PreGdrFusion::kNone, gdr::PreGdrFusion::kGate}) {
    model->set_pre_gdr_fusion(fusion);
    std::vector<float> samples;
    for (int i = 0; i < 7; ++i) {
      cudaEvent_t start, stop;
      cudaEventCreate(&start);
      cudaEventCreate(&stop);
      model->zero_grad();
      cudaEventRecord(start, stream);
      model->loss(ids, ids).backward();
      cudaEventRecord(stop, stream);
      cudaEventSynchronize(stop);
      float ms = 0;
      cudaEventElapsedTime(&ms, start, stop);
      if (i >= 2) samples.push_back(ms);
    }
    std::sort(samples.begin(), samples.end());
    const float median = samples[samples.size() / 2];
    std::printf("| %s | %.1f | %.0f |\n", std::string(gdr::pre_gdr_fusion_name(fusion)).c_str(),
                median, seq / (median * 1e-3));
  }
  return 0;
}
