// The mapper families (mapping/orthogonal.h): dense and srht against the block default - orthogonality
// and expansion of the materialised W, the structured application against the explicit matrix,
// gradients (first and second order), determinism from the seed and across thread counts, the dense
// family's memory cap, the option plumbing (MappingOptions::mapper), checkpoints that refuse latents
// of another family, and mn-train --mapper end to end.
#include <omp.h>

#include <algorithm>
#include <nlohmann/json.hpp>

#include "autograd/gradcheck.h"
#include "mapping/checkpoint.h"
#include "mapping/mapping_model.h"
#include "mapping/srht.h"
#include "mapping/targets.h"
#include "nn/safetensors.h"
#include "tests/mn_train_exe.h"
#include "tests/run_command.h"
#include "tests/temp_dir.h"
#include "tests/test_support.h"

using namespace mn;
using namespace mn::mapping;
using mn::testing::check_close;

namespace {

bool same_bits(const Tensor& a, const Tensor& b) { return a.to_vector<float>() == b.to_vector<float>(); }

MapperMatrixOptions family(MapperFamily f) {
  MapperMatrixOptions o;
  o.family = f;
  return o;
}

// W^T W (or W W^T for a wide W) against expansion^2 I, and the structured products against the
// explicit matrix.
void check_orthogonal(const OrthogonalMatrix& w, double tol) {
  const int64_t rows = w.rows(), cols = w.cols();
  const Tensor dense = w.materialize();
  REQUIRE(dense.sizes() == Shape{rows, cols});
  const Tensor gram = rows >= cols ? matmul(dense.t(), dense) : matmul(dense, dense.t());
  const int64_t k = std::min(rows, cols);
  std::vector<float> eye(static_cast<size_t>(k * k), 0.0f);
  for (int64_t i = 0; i < k; ++i) eye[static_cast<size_t>(i * k + i)] = 1.0f;
  // Divided by expansion^2 = max(rows, cols): the identity to float precision.
  check_close(div(gram, static_cast<double>(std::max(rows, cols))), eye, tol);
  Generator gen(5);
  const Tensor z = randn({cols}, {}, &gen), u = randn({rows}, {}, &gen);
  check_close(w.apply(z), matmul(dense, z).to_vector<float>(), 1e-4);
  check_close(w.apply_transpose(u), matmul(dense.t(), u).to_vector<float>(), 1e-4);
  check_close(w.column_mean(), mean(dense, {0}).to_vector<float>(), 1e-4);
}

}  // namespace

TEST_CASE("mapper families: names parse, unknown ones are refused with the choices") {
  CHECK(parse_mapper_family("block") == MapperFamily::Block);
  CHECK(parse_mapper_family("dense") == MapperFamily::Dense);
  CHECK(parse_mapper_family("srht") == MapperFamily::Srht);
  CHECK_THROWS_WITH_AS(parse_mapper_family("fastfood"),
                       "Unknown mapper family 'fastfood'; choose from: block, dense, srht", ValueError);
  CHECK(std::string(mapper_construction(MapperFamily::Block)) == kMapperConstruction);
  CHECK(std::string(mapper_construction(MapperFamily::Srht)) != mapper_construction(MapperFamily::Dense));
}

TEST_CASE("mapper families: srht and dense have orthonormal columns (or rows) times the expansion") {
  // srht: full blocks only (64 x 8), a spread tail (37 x 8, 100 x 24), many blocks with a tail
  // (3000 x 100), a wide W (8 x 37: the transpose of a 37 x 8 map).
  for (auto [rows, cols] :
       std::vector<std::pair<int64_t, int64_t>>{{64, 8}, {37, 8}, {100, 24}, {3000, 100}, {8, 37}, {1, 1}}) {
    INFO("srht " << rows << "x" << cols);
    const OrthogonalMatrix w = OrthogonalMatrix::build(11, "g", rows, cols, true, kCPU, family(MapperFamily::Srht));
    CHECK(w.hadamard());
    CHECK(w.bytes() == 0);  // regenerated, never stored
    check_orthogonal(w, 1e-5);
  }
  // Between the shapes the Hadamard blocks fit (rows < the power of two >= cols): the block fallback.
  const OrthogonalMatrix fallback =
      OrthogonalMatrix::build(11, "g", 20, 24, true, kCPU, family(MapperFamily::Srht));
  CHECK_FALSE(fallback.hadamard());
  CHECK(same_bits(fallback.materialize(), OrthogonalMatrix::build(11, "g", 20, 24, true).materialize()));
  for (auto [rows, cols] : std::vector<std::pair<int64_t, int64_t>>{{40, 8}, {37, 8}, {300, 16}, {5, 8}}) {
    INFO("dense " << rows << "x" << cols);
    const OrthogonalMatrix w = OrthogonalMatrix::build(11, "g", rows, cols, true, kCPU, family(MapperFamily::Dense));
    CHECK(w.bytes() == static_cast<size_t>(rows * cols * 4));
    check_orthogonal(w, 1e-5);
  }
  // Below two blocks the block family is one dense tail: the same matrix as dense.
  CHECK(same_bits(OrthogonalMatrix::build(2, "g", 12, 8, true, kCPU, family(MapperFamily::Dense)).materialize(),
                  OrthogonalMatrix::build(2, "g", 12, 8, true).materialize()));
  // Unexpanded: W^T W = I.
  const OrthogonalMatrix plain = OrthogonalMatrix::build(4, "h", 48, 8, false, kCPU, family(MapperFamily::Srht));
  std::vector<float> eye(64, 0.0f);
  for (size_t i = 0; i < 8; ++i) eye[i * 9] = 1.0f;
  check_close(matmul(plain.materialize().t(), plain.materialize()), eye, 2e-6);
}

TEST_CASE("mapper families: srht is a pure function of the seed, bit-identical for 1 and 2 threads") {
  const int threads = omp_get_max_threads();
  // 40,000 x 100: 312 blocks of 128 and a tail of 64 rows, above the kernels' parallel threshold.
  const int64_t rows = 40000, cols = 100;
  const OrthogonalMatrix w = OrthogonalMatrix::build(3, "layer", rows, cols, true, kCPU, family(MapperFamily::Srht));
  Generator gen(8);
  const Tensor z = randn({cols}, {}, &gen), u = randn({rows}, {}, &gen);
  omp_set_num_threads(1);
  const Tensor y1 = w.apply(z), g1 = w.apply_transpose(u);
  omp_set_num_threads(2);
  const Tensor y2 = w.apply(z), g2 = w.apply_transpose(u);
  omp_set_num_threads(threads);
  CHECK(same_bits(y1, y2));
  CHECK(same_bits(g1, g2));
  // A rebuilt matrix gives the same bits; another key or seed another matrix.
  const OrthogonalMatrix again = OrthogonalMatrix::build(3, "layer", rows, cols, true, kCPU, family(MapperFamily::Srht));
  CHECK(same_bits(again.apply(z), y1));
  CHECK_FALSE(same_bits(OrthogonalMatrix::build(3, "other", rows, cols, true, kCPU, family(MapperFamily::Srht)).apply(z), y1));
  CHECK_FALSE(same_bits(OrthogonalMatrix::build(4, "layer", rows, cols, true, kCPU, family(MapperFamily::Srht)).apply(z), y1));
  // W z has the expanded norm: ||W z|| = sqrt(rows) ||z||.
  CHECK(norm(y1).item() == doctest::Approx(std::sqrt(static_cast<double>(rows)) * norm(z).item()).epsilon(1e-4));
  // Dense: the same seed gives the same matrix.
  CHECK(same_bits(OrthogonalMatrix::build(3, "d", 200, 16, true, kCPU, family(MapperFamily::Dense)).materialize(),
                  OrthogonalMatrix::build(3, "d", 200, 16, true, kCPU, family(MapperFamily::Dense)).materialize()));
}

TEST_CASE("mapper families: apply and apply_transpose pass gradcheck and gradgradcheck") {
  for (MapperFamily f : {MapperFamily::Block, MapperFamily::Dense, MapperFamily::Srht}) {
    for (auto [rows, cols] : std::vector<std::pair<int64_t, int64_t>>{{37, 8}, {8, 37}}) {
      INFO(mapper_family_name(f) << " " << rows << "x" << cols);
      // Unexpanded, so the central differences stay within the f32 tolerances.
      const OrthogonalMatrix w = OrthogonalMatrix::build(6, "g", rows, cols, false, kCPU, family(f));
      Generator gen(2);
      const Tensor z = randn({cols}, {}, &gen).requires_grad_(true);
      const Tensor u = randn({rows}, {}, &gen).requires_grad_(true);
      // Squared outputs, so the second derivative is not zero.
      const auto fwd = [&](const std::vector<Tensor>& v) { return mul(w.apply(v[0]), w.apply(v[0])); };
      const auto bwd = [&](const std::vector<Tensor>& v) {
        return mul(w.apply_transpose(v[0]), w.apply_transpose(v[0]));
      };
      CHECK(autograd::gradcheck(fwd, {z}) == "");
      CHECK(autograd::gradgradcheck(fwd, {z}) == "");
      CHECK(autograd::gradcheck(bwd, {u}) == "");
      CHECK(autograd::gradgradcheck(bwd, {u}) == "");
    }
  }
  // Through a whole mapper (additive modulation on top).
  MapperMatrixOptions srht = family(MapperFamily::Srht);
  MLPMapper mapper(8, 70, 1, "m", {}, Modulation::additive(), nullptr, nullptr, srht);
  CHECK(mapper.describe() == "MLPMapper(8 -> 70, additive, srht)");
  const Tensor z = mul(randn({8}), 0.3).requires_grad_(true);
  CHECK(autograd::gradcheck([&](const std::vector<Tensor>& v) { return mapper.forward(v[0]); }, {z}) == "");
}

TEST_CASE("mapper families: the dense family states the bytes it would need and the cap") {
  MapperMatrixOptions dense = family(MapperFamily::Dense);
  dense.max_dense_bytes = 1000;
  CHECK_THROWS_WITH_AS(OrthogonalMatrix::build(0, "big", 100, 8, true, kCPU, dense),
                       "the dense mapper matrix 'big' (100 x 8) would need 3,200 bytes as an explicit f32 matrix, "
                       "above the cap of 1,000 bytes (max_dense_bytes); use the block or srht mapper family, "
                       "which never store it",
                       MemoryError);
  CHECK_NOTHROW(OrthogonalMatrix::build(0, "big", 100, 2, true, kCPU, dense));  // 800 bytes
  // allow_large lifts the cap to what the machine can hold, but not to 4 PB.
  dense.allow_large = true;
  CHECK_NOTHROW(OrthogonalMatrix::build(0, "big", 100, 8, true, kCPU, dense));
  CHECK_THROWS_WITH_AS(OrthogonalMatrix::build(0, "huge", int64_t{1} << 40, 1024, true, kCPU, dense),
                       doctest::Contains("would need 4,503,599,627,370,496 bytes"), MemoryError);
  // Through MappingOptions: a 1 MiB cap refuses CNN2's layer-wise groups at L = 256.
  MappingOptions o;
  o.strategy = "layerwise";
  o.latent_dim = 256;
  o.mapper = "dense";
  o.allow_large = false;
  o.max_dense_mapper_bytes = 1 << 20;
  CHECK_THROWS_WITH_AS(MappingModel(make_target("cnn2"), o), doctest::Contains("max_dense_bytes"), MemoryError);
  // The biggest group is refused before any group is built, and named.
  CHECK_THROWS_WITH_AS(MappingModel(make_target("cnn2"), o), doctest::Contains("'mapper/"), MemoryError);
  o.mapper = "circulant";
  CHECK_THROWS_WITH_AS(MappingModel(make_target("cnn2"), o), doctest::Contains("choose from: block, dense, srht"),
                       ValueError);
}

TEST_CASE("mapper families: a MappingModel's slvt guard counts what its default mapper stores") {
  // CNN2 slvt at L = 2,048: L x N = 222,449,664 elements as a dense matrix, above the 1e8 guard, but the
  // block family stores a 2,048 x 2,048 block, signs and a tail. MappingModel used to hand the generator
  // its default factory as if it were a user's, so the guard counted L x N and refused the README's
  // slvt command without --allow-large.
  MappingOptions o;
  o.strategy = "slvt";
  o.latent_dim = 2048;
  MappingModel block(make_target("cnn2"), o);
  CHECK(block.generator().fixed_bytes() < size_t{100} << 20);
  o.mapper = "srht";
  CHECK_NOTHROW(MappingModel(make_target("cnn2"), o));
  o.mapper = "dense";
  CHECK_THROWS_WITH_AS(MappingModel(make_target("cnn2"), o), doctest::Contains("'dense' family"), MemoryError);
  // A factory of the user's own is custom: the reference's L x N count applies.
  o.mapper = "block";
  o.mapper_factory = default_mapper_factory();
  CHECK_THROWS_WITH_AS(MappingModel(make_target("cnn2"), o), doctest::Contains("222,449,664"), MemoryError);
  // alpha still reaches the default mapper: the same seed with another alpha generates other weights.
  MappingOptions a;
  a.latent_dim = 64;
  a.parameter_scaling = false;  // the scales follow each target instance's random init
  MappingModel m1(make_target("cnn2"), a), m1_again(make_target("cnn2"), a);
  a.alpha = 0.5;
  MappingModel m2(make_target("cnn2"), a);
  const Tensor w1 = m1.generate_parameters().at("0.weight");
  CHECK(same_bits(w1, m1_again.generate_parameters().at("0.weight")));
  CHECK_FALSE(same_bits(w1, m2.generate_parameters().at("0.weight")));
}

TEST_CASE("mapper families: MappingOptions::mapper reaches every group, and checkpoints refuse another family") {
  mn::testing::TempDir dir("mapper_families");
  auto build = [](const std::string& mapper) {
    MappingOptions o;
    o.latent_dim = 24;
    o.seed = 5;
    o.mapper = mapper;
    return std::make_unique<MappingModel>(make_target("cnn2"), o);
  };
  auto block = build("block"), srht = build("srht"), dense = build("dense");
  CHECK(srht->generator().fixed_bytes() < block->generator().fixed_bytes());
  CHECK(dense->generator().fixed_bytes() > block->generator().fixed_bytes());
  for (const auto& g : srht->generator().groups()) CHECK(g.mapper->describe().find("srht") != std::string::npos);
  // Same latents (they depend on the seed and group only), different parameters.
  const ParameterTree a = block->generate_parameters(), b = srht->generate_parameters();
  CHECK(same_bits(block->named_latents()[0].second, srht->named_latents()[0].second));
  CHECK_FALSE(same_bits(a.at("0.weight"), b.at("0.weight")));
  // Parameters keep the target's init scale whatever the family.
  for (const auto& [name, t] : b.items())
    if (t.numel() > 1000) CHECK(std_dev(t).item() == doctest::Approx(std_dev(a.at(name)).item()).epsilon(0.1));

  save_checkpoint(dir.file("srht.safetensors"), *srht);
  save_checkpoint(dir.file("block.safetensors"), *block);
  const auto meta = safetensors::load(dir.file("srht.safetensors")).metadata;
  const auto mapper = nlohmann::json::parse(meta.at("mapper"));
  CHECK(mapper.at("family") == "srht");
  CHECK(mapper.at("construction") == mapper_construction(MapperFamily::Srht));
  CHECK_THROWS_WITH_AS(load_checkpoint(dir.file("srht.safetensors"), *block),
                       doctest::Contains("was saved with the 'srht' mapper family but the model uses 'block'"),
                       ValueError);
  CHECK_THROWS_WITH_AS(load_checkpoint(dir.file("block.safetensors"), *dense),
                       doctest::Contains("was saved with the 'block' mapper family but the model uses 'dense'"),
                       ValueError);
  // The same family loads, and the parameters come back bit for bit.
  auto srht2 = build("srht");
  {
    autograd::NoGradGuard no_grad;
    srht2->named_latents()[0].second.fill_(0.5);
  }
  load_checkpoint(dir.file("srht.safetensors"), *srht2);
  CHECK(same_bits(srht2->generate_parameters().at("0.weight"), b.at("0.weight")));
}

TEST_CASE("mapper families: a checkpoint without the family field means block") {
  mn::testing::TempDir dir("mapper_families_old");
  MappingOptions o;
  o.latent_dim = 16;
  MappingModel block(make_target("cnn2"), o);
  save_checkpoint(dir.file("new.safetensors"), block);
  // Rewrite the file as an older library wrote it: no "family" in the mapper metadata.
  safetensors::File file = safetensors::load(dir.file("new.safetensors"));
  auto mapper = nlohmann::json::parse(file.metadata.at("mapper"));
  mapper.erase("family");
  file.metadata["mapper"] = mapper.dump();
  safetensors::NamedTensors tensors;
  safetensors::StringMap dtypes;
  for (const auto& e : file.tensors) {
    tensors.emplace_back(e.name, e.tensor);
    if (e.dtype != "F32" && e.dtype != "I64") dtypes[e.name] = e.dtype;
  }
  safetensors::save(dir.file("old.safetensors"), tensors, file.metadata, dtypes);
  CHECK_NOTHROW(load_checkpoint(dir.file("old.safetensors"), block));
  o.mapper = "srht";
  MappingModel srht(make_target("cnn2"), o);
  CHECK_THROWS_WITH_AS(load_checkpoint(dir.file("old.safetensors"), srht),
                       doctest::Contains("'block' mapper family but the model uses 'srht'"), ValueError);
}

TEST_CASE("mapper families: mn-train --mapper trains, reports the fixed bytes and --resume keeps the family") {
  std::string exe;
  if (!mn::testing::mn_train_ready(exe)) return;
  mn::testing::TempDir dir("mapper_families_cli");
  const std::string common = " --target cnn2 --strategy layerwise --latent-dim 32 --epochs 1 --limit 256 "
                             "--batch-size 128 --seed 3 --threads 1 --json --out ";
  const auto run = [&](const std::string& args) { return mn::testing::run_command(exe + " " + args); };
  std::map<std::string, int64_t> fixed;
  for (const char* mapper : {"block", "dense", "srht"}) {
    const auto r = run(str("--mapper ", mapper, common, dir.file(mapper)));
    INFO(r.all());
    REQUIRE(r.status == 0);
    const auto j = nlohmann::json::parse(r.last_line());
    CHECK(j.at("mapper") == mapper);
    CHECK(j.at("test_accuracy").get<double>() >= 0.0);
    fixed[mapper] = j.at("fixed_bytes").get<int64_t>();
  }
  CHECK(fixed["srht"] < fixed["block"]);
  CHECK(fixed["block"] < fixed["dense"]);
  // --resume takes the family from the run; another one on the command line is refused.
  const auto conflict = run(str("--resume --epochs 2 --mapper block --json --out ", dir.file("srht")));
  CHECK(conflict.status != 0);
  CHECK(conflict.all().find("--mapper: the run has \"srht\", the command line \"block\"") != std::string::npos);
  const auto resumed = run(str("--resume --epochs 2 --threads 1 --json --out ", dir.file("srht")));
  INFO(resumed.all());
  REQUIRE(resumed.status == 0);
  CHECK(nlohmann::json::parse(resumed.last_line()).at("mapper") == "srht");
  const auto direct = run(str("--strategy direct --mapper srht --epochs 1 --limit 128 --out ", dir.file("d")));
  CHECK(direct.status != 0);
  CHECK(direct.all().find("--mapper srht chooses the fixed matrices of a mapper") != std::string::npos);
}
