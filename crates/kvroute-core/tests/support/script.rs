//! The script runner the `*_script.rs` tests share: a script is a text file of one input per
//! line (`#` comments and blank lines kept as they are); each input's answer is written after
//! it as `input => answer`, a check runs after every input, and the whole transcript must equal
//! the `.expected` file beside the script (`UPDATE_EXPECT=1` rewrites it). Included with
//! `#[path]`, beside a `scripts!` list of the test names, one per script.

use std::path::Path;

use expect_test::expect_file;

/// What a script drives.
pub trait Harness {
    /// Takes one input; its answer.
    fn run(&mut self, input: &str) -> String;
    /// The invariants to hold after every input.
    fn check(&self) -> Result<(), String>;
}

/// Runs script `name` from `dir` through `harness`, checking it after each input (an `Err`
/// fails the test, naming the input).
pub fn run_file(dir: &Path, name: &str, harness: &mut impl Harness) {
    let script = std::fs::read_to_string(dir.join(format!("{name}.txt")))
        .unwrap_or_else(|e| panic!("reading {name}.txt: {e}"));
    let mut out = String::new();
    for line in script.lines() {
        let trimmed = line.trim();
        if trimmed.is_empty() || trimmed.starts_with('#') {
            out.push_str(line);
            out.push('\n');
            continue;
        }
        let result = harness.run(trimmed);
        out.push_str(&format!("{trimmed} => {result}\n"));
        if let Err(e) = harness.check() {
            panic!("{name}: after `{trimmed}`: {e}");
        }
    }
    expect_file![dir.join(format!("{name}.expected"))].assert_eq(&out);
}

/// One `#[test]` per script name, each running `run_script(name)` of the including file.
macro_rules! scripts {
    ($($name:ident),* $(,)?) => {
        $(
            #[test]
            fn $name() {
                run_script(stringify!($name));
            }
        )*
    };
}
