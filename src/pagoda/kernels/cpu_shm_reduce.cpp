// An all-reduce between the tensor-parallel ranks of one machine, through a shared-memory region.
//
// gloo's all-reduce goes through loopback TCP and a helper thread per peer: on a small VM one of a decode step's
// 2 x layers all-reduces of a few KiB takes ~1 ms, a third of a bench-1b step at TP = 2. Here each rank copies its
// partial sums into its own slot of the region (widened to fp32), publishes the call's sequence number, waits
// until every rank has published it, and sums the slots itself, in rank order: every rank computes the same sum,
// bit for bit, whatever the timing. Two slots a rank alternate between calls, so a rank that runs ahead writes the
// slot the others finished reading a call ago (it could not have started call n + 2 before they all published
// call n + 1, which they do after reading call n).
//
// The region (model/shm_all_reduce.py maps it): a header of one 64-byte line per rank, holding the last sequence
// number it published, then the abort word (set by a rank that gives up, so that the others stop waiting), then
// the data: [2][ranks][capacity] fp32.
#include <sched.h>
#include <signal.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "cpu_ops.h"

namespace {

constexpr int64_t kLine = 64;  // bytes: a rank's sequence number alone on its cache line

int64_t* sequence_word(uint8_t* region, int64_t rank) { return reinterpret_cast<int64_t*>(region + rank * kLine); }

int64_t* abort_word(uint8_t* region, int64_t ranks) { return reinterpret_cast<int64_t*>(region + ranks * kLine); }

// Whether process `pid` still runs (a zombie runs nothing: its peers would wait on it forever).
bool process_alive(int64_t pid) {
  const std::string path = "/proc/" + std::to_string(pid) + "/stat";
  FILE* file = std::fopen(path.c_str(), "r");
  if (file == nullptr) return false;
  char line[512];
  const size_t read = std::fread(line, 1, sizeof(line) - 1, file);
  std::fclose(file);
  line[read] = '\0';
  const char* end_of_name = std::strrchr(line, ')');  // the state follows the command name: "pid (name) S ..."
  return end_of_name == nullptr || end_of_name[1] == '\0' || end_of_name[2] != 'Z';
}

// x (fp32 or bf16, contiguous, at most `capacity` elements) summed over the ranks in place. sequence: this call's
// number, 1 for the first and one more each call, the same on every rank. peer_pids: every rank's process id.
void shm_all_reduce_(torch::Tensor x, torch::Tensor region, int64_t rank, int64_t capacity, int64_t sequence,
                     const std::vector<int64_t>& peer_pids, double timeout_s) {
  const int64_t ranks = static_cast<int64_t>(peer_pids.size());
  TORCH_CHECK(x.is_contiguous() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x: a contiguous fp32 or bf16 tensor");
  TORCH_CHECK(x.numel() <= capacity && rank >= 0 && rank < ranks && sequence > 0, "x beyond the region's capacity");
  uint8_t* base = region.data_ptr<uint8_t>();
  TORCH_CHECK(region.numel() >= (ranks + 1) * kLine + 2 * ranks * capacity * 4, "the region is too small");
  float* data = reinterpret_cast<float*>(base + (ranks + 1) * kLine);
  auto slot = [&](int64_t of) { return data + ((sequence & 1) * ranks + of) * capacity; };
  const int64_t n = x.numel();
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  float* mine = slot(rank);
  if (bf16) {
    const at::BFloat16* in = x.data_ptr<at::BFloat16>();
    for (int64_t i = 0; i < n; ++i) mine[i] = static_cast<float>(in[i]);
  } else {
    std::memcpy(mine, x.data_ptr<float>(), n * sizeof(float));
  }
  __atomic_store_n(sequence_word(base, rank), sequence, __ATOMIC_RELEASE);
  const auto started = std::chrono::steady_clock::now();
  auto next_check = started;
  for (int64_t peer = 0; peer < ranks; ++peer) {
    for (uint64_t spins = 0; __atomic_load_n(sequence_word(base, peer), __ATOMIC_ACQUIRE) < sequence; ++spins) {
      if (spins % 64 != 63) continue;
      sched_yield();  // a rank that waits gives its core to the one it waits on, where cores are few
      const auto now = std::chrono::steady_clock::now();
      if (now < next_check) continue;
      next_check = now + std::chrono::milliseconds(50);
      TORCH_CHECK(__atomic_load_n(abort_word(base, ranks), __ATOMIC_ACQUIRE) == 0,
                  "shared-memory all-reduce: another rank gave up");
      TORCH_CHECK(process_alive(peer_pids[peer]), "shared-memory all-reduce: tensor-parallel rank ", peer,
                  " (pid ", peer_pids[peer], ") exited");
      if (std::chrono::duration<double>(now - started).count() > timeout_s) {
        __atomic_store_n(abort_word(base, ranks), 1, __ATOMIC_RELEASE);
        TORCH_CHECK(false, "shared-memory all-reduce: rank ", peer, " did not arrive within ", timeout_s, " s");
      }
    }
  }
  std::vector<const float*> slots(ranks);
  for (int64_t of = 0; of < ranks; ++of) slots[of] = slot(of);
  at::BFloat16* out_bf16 = bf16 ? x.data_ptr<at::BFloat16>() : nullptr;
  float* out_fp32 = bf16 ? nullptr : x.data_ptr<float>();
  at::parallel_for(0, n, 4096, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float sum = slots[0][i];
      for (int64_t of = 1; of < ranks; ++of) sum += slots[of][i];
      if (bf16)
        out_bf16[i] = static_cast<at::BFloat16>(sum);
      else
        out_fp32[i] = sum;
    }
  });
}

// Tells the other ranks to stop waiting (a rank that fails or shuts down while they may be in a call).
void shm_abort(torch::Tensor region, int64_t ranks) {
  __atomic_store_n(abort_word(region.data_ptr<uint8_t>(), ranks), 1, __ATOMIC_RELEASE);
}

}  // namespace

void define_shm_all_reduce(pybind11::module& m) {
  m.def("shm_all_reduce_", &shm_all_reduce_, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "x summed over the ranks of one machine in place, through a shared-memory region (rank, capacity in "
        "elements, the call's sequence number, every rank's pid, timeout in seconds)");
  m.def("shm_abort", &shm_abort, "region, ranks: the other ranks' waits in shm_all_reduce_ fail");
  m.attr("shm_line_bytes") = kLine;
}
