// The CPU decode kernels' launcher: checks a call's tensors and calls a Numba entry point
// (pagedkv/ops/cpu_entry.py) by address, all in one C++ call.
//
// From Python the same checks and the Numba dispatch cost ~13 us on a 0.1 ms call right
// after another kernel (every tensor attribute read is a call into torch, 3-5x its hot cost
// on a cold cache); here they are inline reads of the tensors' metadata. A function returns
// None for anything it does not take as it is (the caller then takes the general path,
// which validates everything and names the error), never raises for bad input.
//
// The slot numbers are cpu_entry's CALL_*, CACHES_* and PLAN_* constants.

#include <torch/extension.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

constexpr int kCallQuery = 0, kCallOut = 1, kCallNumTokens = 2, kCallNumHeads = 3,
              kCallScale = 4, kCallStatus = 5, kCallTables = 6, kCallNumSeqs = 7,
              kCallMaxBlocks = 8, kCallLens = 9, kCallStarts = 10, kCallWindow = 11;
constexpr int kCallBlock = 64;  // >= CALL_BLOCK: the CALL slots, then room for the WORK block
constexpr int kCachesKey = 0, kCachesValue = 1, kCachesHeadDim = 2, kCachesNumKvHeads = 3,
              kCachesMaxDecodeQuery = 4;
constexpr int kPlanNumTokens = 0;
constexpr int kWriteKey = 0, kWriteValue = 1, kWriteSlots = 2, kWriteIsInt64 = 3,
              kWriteNumTokens = 4, kWriteResult = 5, kWriteBlock = 6;
constexpr int kRowsKey = 0, kRowsValue = 1, kRowsNumKvHeads = 2, kRowsHeadDim = 3;
constexpr int64_t kOk = 0;

using Entry = void (*)(int64_t*, const int64_t*, const int64_t*);
using WriteEntry = void (*)(int64_t*, const int64_t*);

// The query's checks shared by both calls, against the cache pair's CACHES block; false:
// not this path.
bool query_fits(const at::Tensor& query, const at::Tensor& key_cache,
                const at::Tensor& value_cache, const int64_t* caches) {
  return query.dim() == 3 && query.device().is_cpu() &&
         query.scalar_type() == key_cache.scalar_type() &&
         query.size(2) == caches[kCachesHeadDim] &&
         query.size(1) % caches[kCachesNumKvHeads] == 0 &&
         // The cache pair still has the storage its CACHES block was made from.
         reinterpret_cast<int64_t>(key_cache.data_ptr()) == caches[kCachesKey] &&
         reinterpret_cast<int64_t>(value_cache.data_ptr()) == caches[kCachesValue];
}

// None (1 / sqrt(head_dim)) or a finite float; its value through `scale_out`.
bool read_scale(const py::object& scale, int64_t head_dim, double* scale_out) {
  if (scale.is_none()) {
    *scale_out = 1.0 / std::sqrt(static_cast<double>(head_dim));
    return true;
  }
  if (!PyFloat_CheckExact(scale.ptr())) return false;
  *scale_out = PyFloat_AS_DOUBLE(scale.ptr());
  return std::isfinite(*scale_out);
}

bool is_index(const at::Tensor& t, int64_t dims) {
  return t.dim() == dims && t.scalar_type() == at::kInt && t.device().is_cpu();
}

// Runs the entry on a float32 copy of the query (the query itself when it is one) and
// returns the output in the query's dtype, or None when the entry reports a status.
py::object run(Entry entry, const at::Tensor& query, double scale, int64_t* call,
               const int64_t* caches, const int64_t* plan) {
  const at::Tensor q = query.to(at::kFloat).contiguous();
  at::Tensor out = at::empty(q.sizes(), q.options());
  call[kCallQuery] = reinterpret_cast<int64_t>(q.data_ptr());
  call[kCallOut] = reinterpret_cast<int64_t>(out.data_ptr());
  call[kCallNumTokens] = q.size(0);
  call[kCallNumHeads] = q.size(1);
  std::memcpy(&call[kCallScale], &scale, sizeof(double));
  call[kCallStatus] = -1;
  entry(call, caches, plan);
  if (call[kCallStatus] != kOk) return py::none();
  if (query.scalar_type() != at::kFloat) out = out.to(query.scalar_type());
  return py::cast(out);
}

}  // namespace

// A later layer of a decode step: its plan (the PLAN block) was built and checked by the
// first layer, so only the query and the scale are checked here.
py::object decode(const at::Tensor& query, const at::Tensor& key_cache,
                  const at::Tensor& value_cache, const at::Tensor& caches_block,
                  const at::Tensor& plan_block, const py::object& scale, int64_t entry) {
  const int64_t* caches = caches_block.data_ptr<int64_t>();
  const int64_t* plan = plan_block.data_ptr<int64_t>();
  double scale_value;
  if (!query_fits(query, key_cache, value_cache, caches) ||
      query.size(0) != plan[kPlanNumTokens] ||
      !read_scale(scale, caches[kCachesHeadDim], &scale_value)) {
    return py::none();
  }
  int64_t call[kCallBlock] = {};
  return run(reinterpret_cast<Entry>(entry), query, scale_value, call, caches, plan);
}

// A plain call: the entry checks lengths and block ids while it plans, and reports a status
// (an error to name, or a prefill sequence) instead of running.
py::object plan_and_decode(const at::Tensor& query, const at::Tensor& key_cache,
                           const at::Tensor& value_cache, const at::Tensor& block_tables,
                           const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                           const at::Tensor& caches_block, const py::object& scale,
                           const py::object& sliding_window, int64_t entry) {
  const int64_t* caches = caches_block.data_ptr<int64_t>();
  double scale_value;
  if (!query_fits(query, key_cache, value_cache, caches) || !is_index(block_tables, 2) ||
      !is_index(seq_lens, 1) || !is_index(query_start_loc, 1) ||
      !read_scale(scale, caches[kCachesHeadDim], &scale_value)) {
    return py::none();
  }
  const int64_t num_seqs = block_tables.size(0);
  if (seq_lens.size(0) != num_seqs || query_start_loc.size(0) != num_seqs + 1 ||
      query.size(0) > caches[kCachesMaxDecodeQuery] * num_seqs) {
    return py::none();  // a bad length, or some sequence is a prefill
  }
  int64_t window = 0;
  if (!sliding_window.is_none()) {
    if (!PyLong_CheckExact(sliding_window.ptr())) return py::none();
    int overflow = 0;
    window = PyLong_AsLongLongAndOverflow(sliding_window.ptr(), &overflow);
    if (overflow != 0 || window < 1) return py::none();
  }
  const at::Tensor tables = block_tables.contiguous();
  const at::Tensor lens = seq_lens.contiguous();
  const at::Tensor starts = query_start_loc.contiguous();
  int64_t call[kCallBlock] = {};
  call[kCallTables] = reinterpret_cast<int64_t>(tables.data_ptr());
  call[kCallNumSeqs] = num_seqs;
  call[kCallMaxBlocks] = tables.size(1);
  call[kCallLens] = reinterpret_cast<int64_t>(lens.data_ptr());
  call[kCallStarts] = reinterpret_cast<int64_t>(starts.data_ptr());
  call[kCallWindow] = window;
  return run(reinterpret_cast<Entry>(entry), query, scale_value, call, caches, nullptr);
}

// `write_kv` into a known cache pair (the ROWS block): None when not taken, else -1, or the
// first token whose slot is past the end (nothing written for it; the caller raises).
py::object write_kv(const at::Tensor& key, const at::Tensor& value, const at::Tensor& key_cache,
                 const at::Tensor& value_cache, const at::Tensor& slot_mapping,
                 const at::Tensor& rows_block, int64_t entry) {
  const int64_t* rows = rows_block.data_ptr<int64_t>();
  const auto slots_type = slot_mapping.scalar_type();
  if (key.dim() != 3 || value.sizes() != key.sizes() || key.size(1) != rows[kRowsNumKvHeads] ||
      key.size(2) != rows[kRowsHeadDim] || slot_mapping.dim() != 1 ||
      slot_mapping.size(0) != key.size(0) || (slots_type != at::kLong && slots_type != at::kInt) ||
      key.scalar_type() != key_cache.scalar_type() ||
      value.scalar_type() != key_cache.scalar_type() || !key.device().is_cpu() ||
      !value.device().is_cpu() || !slot_mapping.device().is_cpu() ||
      reinterpret_cast<int64_t>(key_cache.data_ptr()) != rows[kRowsKey] ||
      reinterpret_cast<int64_t>(value_cache.data_ptr()) != rows[kRowsValue]) {
    return py::none();
  }
  const at::Tensor k = key.contiguous(), v = value.contiguous(), s = slot_mapping.contiguous();
  int64_t call[kWriteBlock] = {};
  call[kWriteKey] = reinterpret_cast<int64_t>(k.data_ptr());
  call[kWriteValue] = reinterpret_cast<int64_t>(v.data_ptr());
  call[kWriteSlots] = reinterpret_cast<int64_t>(s.data_ptr());
  call[kWriteIsInt64] = slots_type == at::kLong;
  call[kWriteNumTokens] = k.size(0);
  reinterpret_cast<WriteEntry>(entry)(call, rows);
  return py::int_(call[kWriteResult]);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode", &decode);
  m.def("plan_and_decode", &plan_and_decode);
  m.def("write", &write_kv);
  // For the loader to check against cpu_entry's constants.
  m.attr("CALL_BLOCK") = kCallBlock;
  py::dict slots;
  slots["CALL_QUERY"] = kCallQuery;
  slots["CALL_OUT"] = kCallOut;
  slots["CALL_NUM_TOKENS"] = kCallNumTokens;
  slots["CALL_NUM_HEADS"] = kCallNumHeads;
  slots["CALL_SCALE"] = kCallScale;
  slots["CALL_STATUS"] = kCallStatus;
  slots["CALL_TABLES"] = kCallTables;
  slots["CALL_NUM_SEQS"] = kCallNumSeqs;
  slots["CALL_MAX_BLOCKS"] = kCallMaxBlocks;
  slots["CALL_LENS"] = kCallLens;
  slots["CALL_STARTS"] = kCallStarts;
  slots["CALL_WINDOW"] = kCallWindow;
  slots["CACHES_KEY"] = kCachesKey;
  slots["CACHES_VALUE"] = kCachesValue;
  slots["CACHES_HEAD_DIM"] = kCachesHeadDim;
  slots["CACHES_NUM_KV_HEADS"] = kCachesNumKvHeads;
  slots["CACHES_MAX_DECODE_QUERY"] = kCachesMaxDecodeQuery;
  slots["PLAN_NUM_TOKENS"] = kPlanNumTokens;
  slots["WRITE_KEY"] = kWriteKey;
  slots["WRITE_VALUE"] = kWriteValue;
  slots["WRITE_SLOTS"] = kWriteSlots;
  slots["WRITE_IS_INT64"] = kWriteIsInt64;
  slots["WRITE_NUM_TOKENS"] = kWriteNumTokens;
  slots["WRITE_RESULT"] = kWriteResult;
  slots["WRITE_SLOTS_COUNT"] = kWriteBlock;
  slots["ROWS_KEY"] = kRowsKey;
  slots["ROWS_VALUE"] = kRowsValue;
  slots["ROWS_NUM_KV_HEADS"] = kRowsNumKvHeads;
  slots["ROWS_HEAD_DIM"] = kRowsHeadDim;
  slots["OK"] = kOk;
  m.attr("SLOTS") = slots;
}
