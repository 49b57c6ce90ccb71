// API keys (serve/api_keys.h): the key file's parser takes good files (comments, blank lines,
// CRLF, blanks around the parts) and refuses bad ones with an error naming the file and line and
// never quoting a key; a key matches only itself; session ids are scoped by key name so that no
// two names, and no name and the default namespace, share one.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "common/test_util.h"
#include "serve/api_keys.h"

namespace d2o::serve {
namespace {

constexpr const char* kKeyA = "aaaaaaaaaaaaaaaa-1";
constexpr const char* kKeyB = "bbbbbbbbbbbbbbbb.2";

TEST(ServeKeys, ParsesAGoodFile) {
  std::string text = "# who may use this server\n\n";
  text += std::string("alice:") + kKeyA + "\r\n";
  text += "   \t\n  # indented comment\n";
  text += std::string("  bob.v2-x_y : ") + kKeyB + "  \n";
  text += "default:" + std::string(4096, '~');  // no final newline
  auto keys = parse_api_keys(text, "keys.txt");
  ASSERT_TRUE(keys.ok()) << keys.status().to_string();
  ASSERT_EQ(keys->size(), 3u);
  EXPECT_EQ((*keys)[0].name, "alice");
  EXPECT_EQ((*keys)[0].key, kKeyA);
  EXPECT_EQ((*keys)[1].name, "bob.v2-x_y");
  EXPECT_EQ((*keys)[1].key, kKeyB);
  EXPECT_EQ((*keys)[2].name, "default");
  EXPECT_EQ((*keys)[2].key, std::string(4096, '~'));
  // A key may hold ':' (only the first one separates the name).
  auto colon = parse_api_keys("c:abc:defghijklmnopq\n", "k");
  ASSERT_TRUE(colon.ok()) << colon.status().to_string();
  EXPECT_EQ((*colon)[0].key, "abc:defghijklmnopq");
}

TEST(ServeKeys, BadFilesAreRefusedNamingTheLine) {
  const std::string a = std::string("alice:") + kKeyA + "\n";
  struct Case {
    std::string text;
    std::string message;  // a part of the error
  };
  const std::vector<Case> cases = {
      {"", "keys.txt: no 'name:key' line"},
      {"# only a comment\n\n", "keys.txt: no 'name:key' line"},
      {a + std::string("bob") + kKeyB + "\n", "keys.txt:2: expected 'name:key'"},
      {a + ":" + kKeyB, "keys.txt:2: the name before ':' must be 1-64 characters"},
      {a + "b b:" + kKeyB, "keys.txt:2: the name before ':'"},
      {a + "b/c:" + kKeyB, "keys.txt:2: the name before ':'"},
      {a + "b@c:" + kKeyB, "keys.txt:2: the name before ':'"},
      {a + std::string(65, 'n') + ":" + kKeyB, "keys.txt:2: the name before ':'"},
      {"\n\nbob:short\n", "keys.txt:3: the key of 'bob' has 5 characters; a key needs at least 16"},
      {"bob:\n", "keys.txt:1: the key of 'bob' has 0 characters"},
      {"bob:" + std::string(4097, 'k'), "keys.txt:1: the key of 'bob' is longer than 4096"},
      {"bob:abcdefgh ijklmnopq", "keys.txt:1: the key of 'bob' holds a blank"},
      {"bob:abcdefghijklmnopq\xc3\xa9",
       "keys.txt:1: the key of 'bob' holds a blank or a character"},
      {a + "# x\nalice:" + kKeyB, "keys.txt:3: the name 'alice' is already on line 1"},
      {a + "\nbob:" + kKeyA, "keys.txt:3: the key of 'bob' is also the key of 'alice' (line 1)"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.text.substr(0, 80));
    auto keys = parse_api_keys(c.text, "keys.txt");
    ASSERT_FALSE(keys.ok());
    const std::string& m = keys.status().message();
    EXPECT_NE(m.find(c.message), std::string::npos) << m;
    // No message quotes a key (a line written the wrong way round included).
    for (const char* key : {kKeyA, kKeyB}) EXPECT_EQ(m.find(key), std::string::npos) << m;
  }
  auto reversed = parse_api_keys(std::string(kKeyA) + " alice", "k");  // no ':' at all
  ASSERT_FALSE(reversed.ok());
  EXPECT_EQ(reversed.status().message().find(kKeyA), std::string::npos);
}

TEST(ServeKeys, ReadsAFileAndSaysWhyNot) {
  const std::string dir = d2o::test::scratch_path("serve_keys_test");
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const std::string path = dir + "/keys";
  std::ofstream(path) << "alice:" << kKeyA << "\nbob:" << kKeyB << "\n";
  auto keys = read_api_key_file(path);
  ASSERT_TRUE(keys.ok()) << keys.status().to_string();
  EXPECT_EQ(keys->size(), 2u);
  auto missing = read_api_key_file(dir + "/none");
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find(dir + "/none: cannot read it"), std::string::npos);
  EXPECT_FALSE(read_api_key_file(dir).ok());  // a directory
  std::ofstream(path) << "alice:" << kKeyA << "\nbob\n";
  auto bad = read_api_key_file(path);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find(path + ":2: "), std::string::npos);
  std::filesystem::remove_all(dir);
}

TEST(ServeKeys, AKeyMatchesOnlyItself) {
  const std::vector<ApiKey> keys = {{"alice", kKeyA}, {"bob", kKeyB}};
  ASSERT_NE(match_api_key(keys, kKeyA), nullptr);
  EXPECT_EQ(match_api_key(keys, kKeyA)->name, "alice");
  EXPECT_EQ(match_api_key(keys, kKeyB)->name, "bob");
  const std::string a = kKeyA;
  for (const std::string& wrong :
       {std::string(), a.substr(0, a.size() - 1), a + "x", a + a, std::string("A") + a.substr(1),
        a.substr(0, a.size() - 1) + "2", std::string(a.size(), '\0')}) {
    EXPECT_EQ(match_api_key(keys, wrong), nullptr) << wrong;
  }
  EXPECT_EQ(match_api_key({}, kKeyA), nullptr);
}

TEST(ServeKeys, SessionIdsAreScopedByKeyName) {
  EXPECT_EQ(scoped_session_id("", "conv-1"), "conv-1");         // an open server
  EXPECT_EQ(scoped_session_id("default", "conv-1"), "conv-1");  // --api-key, older files
  EXPECT_EQ(scoped_session_id("alice", "conv-1"), "alice@conv-1");
  EXPECT_NE(scoped_session_id("alice", "conv-1"), scoped_session_id("bob", "conv-1"));
  EXPECT_TRUE(valid_scoped_session_id("conv-1"));
  EXPECT_TRUE(valid_scoped_session_id("alice@conv-1"));
  EXPECT_TRUE(valid_scoped_session_id("..@.."));  // a plain file name once the suffix is on
  EXPECT_TRUE(
      valid_scoped_session_id(scoped_session_id(std::string(64, 'n'), std::string(128, 'i'))));
  for (const char* bad : {"", "@x", "a@", "a@b@c", "default@x", "a/b@x", "a@x/y", "a b@x"}) {
    EXPECT_FALSE(valid_scoped_session_id(bad)) << bad;
  }
  EXPECT_FALSE(valid_key_name(""));
  EXPECT_FALSE(valid_key_name(std::string(65, 'n')));
  EXPECT_TRUE(valid_key_name("A-z_0.9"));
}

}  // namespace
}  // namespace d2o::serve
