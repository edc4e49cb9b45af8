// The main job (`./mn demo`): trains the paper's CNN2 (108,618 parameters) directly on
// Fashion-MNIST with Adam, showing progress, printing test accuracy and writing per-epoch metrics
// (CSV, and a PNG of the curves when gnuplot is installed) to --out.
#include <CLI/CLI.hpp>

#include <cstdio>
#include <filesystem>
#include <fstream>

#include "autograd/node.h"
#include "nn/data/dataloader.h"
#include "nn/data/fashion_mnist.h"
#include "nn/layers.h"
#include "nn/optim.h"
#include "nn/progress.h"

using namespace mn;

namespace {

std::shared_ptr<nn::Sequential> make_cnn2() {
  auto net = std::make_shared<nn::Sequential>();
  net->push_back(std::make_shared<nn::Conv2d>(1, 16, 3));
  net->push_back(std::make_shared<nn::ReLU>());
  net->push_back(std::make_shared<nn::MaxPool2d>(2));
  net->push_back(std::make_shared<nn::Conv2d>(16, 32, 3));
  net->push_back(std::make_shared<nn::ReLU>());
  net->push_back(std::make_shared<nn::MaxPool2d>(2));
  net->push_back(std::make_shared<nn::Flatten>());
  net->push_back(std::make_shared<nn::Linear>(800, 128));
  net->push_back(std::make_shared<nn::ReLU>());
  net->push_back(std::make_shared<nn::Linear>(128, 10));
  return net;
}

// Accuracy of the network on a data set, evaluated in batches without gradients.
double evaluate(nn::Module& net, const data::Dataset& ds, int64_t batch_size) {
  autograd::NoGradGuard no_grad;
  net.eval();
  int64_t correct = 0;
  data::DataLoader loader(ds, {batch_size, false, 0, false});
  for (const data::Batch& b : loader) {
    Tensor pred = argmax(net.forward(b.inputs), 1);
    correct += static_cast<int64_t>(sum(eq(pred, b.targets)).item());
  }
  net.train();
  return static_cast<double>(correct) / static_cast<double>(ds.size());
}

data::Dataset take(const data::Dataset& ds, int64_t n) {
  if (n <= 0 || n >= ds.size()) return ds;
  return {ds.images.narrow(0, 0, n).contiguous(), ds.labels.narrow(0, 0, n).contiguous()};
}

void plot(const std::filesystem::path& csv, const std::filesystem::path& png) {
  if (std::system("command -v gnuplot >/dev/null 2>&1") != 0) return;
  const std::string script = "set datafile separator ','; set terminal png size 800,400; set output '" + png.string() +
                             "'; set key autotitle columnhead; set xlabel 'epoch'; plot '" + csv.string() +
                             "' using 1:3 with linespoints, '' using 1:4 with linespoints, '' using 1:5 with "
                             "linespoints";
  if (std::system(("gnuplot -e \"" + script + "\" 2>/dev/null").c_str()) == 0)
    std::printf("curves: %s\n", png.c_str());
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Train CNN2 on Fashion-MNIST with the mapping_networks engine"};
  int epochs = 3;
  int64_t batch_size = 128, limit = 0;
  double lr = 1e-3;
  uint64_t seed = 0;
  std::string out_dir = "out/demo", data_dir = data::default_fashion_mnist_root();
  app.add_option("--epochs", epochs, "training epochs")->check(CLI::PositiveNumber);
  app.add_option("--batch-size", batch_size, "batch size")->check(CLI::PositiveNumber);
  app.add_option("--lr", lr, "Adam learning rate")->check(CLI::PositiveNumber);
  app.add_option("--seed", seed, "seed for initialisation and shuffling");
  app.add_option("--limit", limit, "use only the first N training and test samples (0 = all)");
  app.add_option("--data", data_dir, "Fashion-MNIST directory");
  app.add_option("--out", out_dir, "directory for metrics.csv (and curves.png)");
  CLI11_PARSE(app, argc, argv);

  try {
    manual_seed(seed);
    data::Dataset train = take(data::load_fashion_mnist("train", data_dir), limit);
    data::Dataset test = take(data::load_fashion_mnist("test", data_dir), limit);
    // Standardised pixels (training-split mean/std) train faster than raw [0, 1] values.
    train.images = data::normalize(train.images);
    test.images = data::normalize(test.images);
    auto net = make_cnn2();
    std::printf("CNN2: %lld parameters, %lld training / %lld test images, Adam lr %g, batch %lld\n",
                static_cast<long long>(net->parameter_count()), static_cast<long long>(train.size()),
                static_cast<long long>(test.size()), lr, static_cast<long long>(batch_size));

    nn::optim::Adam optimizer(net->parameters(), nn::optim::AdamOptions{lr});
    data::DataLoader loader(train, {batch_size, true, seed, false});
    std::filesystem::create_directories(out_dir);
    const std::filesystem::path csv = std::filesystem::path(out_dir) / "metrics.csv";
    std::ofstream metrics(csv);
    metrics << "epoch,seconds,train_loss,train_accuracy,test_accuracy\n";
    double total_seconds = 0, test_acc = 0;
    for (int epoch = 1; epoch <= epochs; ++epoch) {
      loader.set_epoch(static_cast<uint64_t>(epoch));
      Progress progress("epoch " + std::to_string(epoch) + "/" + std::to_string(epochs), loader.size());
      double loss_sum = 0;
      int64_t correct = 0, seen = 0, step = 0;
      for (const data::Batch& b : loader) {
        Tensor logits = net->forward(b.inputs);
        Tensor loss = nn::functional::cross_entropy(logits, b.targets);
        optimizer.zero_grad();
        loss.backward();
        optimizer.step();
        const double l = loss.item();
        loss_sum += l * static_cast<double>(b.targets.size(0));
        {
          autograd::NoGradGuard no_grad;
          correct += static_cast<int64_t>(sum(eq(argmax(logits, 1), b.targets)).item());
        }
        seen += b.targets.size(0);
        char extra[64];
        std::snprintf(extra, sizeof extra, "loss %.4f", loss_sum / static_cast<double>(seen));
        progress.update(++step, extra);
      }
      const double seconds = progress.elapsed_seconds();
      total_seconds += seconds;
      test_acc = evaluate(*net, test, 1000);
      const double train_acc = static_cast<double>(correct) / static_cast<double>(seen);
      char extra[96];
      std::snprintf(extra, sizeof extra, "loss %.4f train acc %.4f test acc %.4f", loss_sum / seen, train_acc,
                    test_acc);
      progress.finish(extra);
      metrics << epoch << ',' << seconds << ',' << loss_sum / seen << ',' << train_acc << ',' << test_acc << '\n';
      metrics.flush();
    }
    std::printf("test accuracy %.2f%% after %d epochs (%.1f s of training); metrics: %s\n", 100.0 * test_acc, epochs,
                total_seconds, csv.c_str());
    plot(csv, std::filesystem::path(out_dir) / "curves.png");
  } catch (const Error& e) {
    std::fprintf(stderr, "mn_demo: %s\n", e.what());
    return 1;
  }
  return 0;
}
