// Internal: the PyTorch state_dict names of the multi-head layer's
// parameters, shared by its two source files (layer.cpp: forward and
// backward; params.cpp: construction and parameters).
#pragma once

namespace attn::detail::mha_names {

inline constexpr const char* kInProjWeight = "in_proj_weight";
inline constexpr const char* kQProjWeight = "q_proj_weight";
inline constexpr const char* kKProjWeight = "k_proj_weight";
inline constexpr const char* kVProjWeight = "v_proj_weight";
inline constexpr const char* kInProjBias = "in_proj_bias";
inline constexpr const char* kOutProjWeight = "out_proj.weight";
inline constexpr const char* kOutProjBias = "out_proj.bias";
inline constexpr const char* kSinks = "sinks";

}  // namespace attn::detail::mha_names
