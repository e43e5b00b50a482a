// The kernel ABI's Rust side, generated from csrc_kernels/abi.cuh (included by build.rs).
//
// abi.cuh keeps to a small subset of C: `#define NAME expr` (integers, earlier names, + - *
// and parentheses; a `u` suffix allowed), `struct Name { type field; type field[DIM]; };`
// with u32 / u64 / earlier struct fields, and `static_assert(sizeof(X) == n, ...)` /
// `alignof(X) == n` (joined by &&). From it this writes, into OUT_DIR:
// - kernel_abi.rs: every #define as `pub const NAME: u64`, and the layout of every struct
//   (natural alignment, as C lays them out: `STRUCTS`, `FIELDS`);
// - kernel_abi_check.rs: const assertions that the #[repr(C)] Rust mirrors (in scope where
//   it is included) have exactly those sizes and field offsets, so a mismatch fails to
//   build.
// It panics (failing the build) when abi.cuh's static_asserts disagree with the layout
// computed here (the compiler checks those same static_asserts against its own layout)
// or when a line is not understood.

use std::collections::HashMap;
use std::path::Path;

/// C field names that are Rust keywords, and the name of the Rust mirror's field.
const RENAMED: [(&str, &str); 1] = [("in", "inp")];

struct Field {
    name: String,
    offset: u64,
    size: u64,
}

struct Struct {
    name: String,
    size: u64,
    align: u64,
    fields: Vec<Field>,
}

pub fn generate(header: &Path, out: &Path) {
    println!("cargo:rerun-if-changed={}", header.display());
    let text = std::fs::read_to_string(header).unwrap_or_else(|e| panic!("reading {}: {e}", header.display()));
    let mut defines: Vec<(String, u64)> = Vec::new();
    let mut structs: Vec<Struct> = Vec::new();
    let mut asserts: Vec<(String, u64, usize)> = Vec::new(); // (sizeof(S) or S.f, value, line)
    let mut current: Option<Struct> = None;
    for (i, raw) in text.lines().enumerate() {
        let line = raw.split("//").next().unwrap().trim();
        let lno = i + 1;
        let fail = |why: &str| -> ! { panic!("{}:{lno}: {why}: {raw}", header.display()) };
        if line.is_empty() || line == "#pragma once" || line.starts_with("typedef ") {
            continue;
        }
        if let Some(s) = current.as_mut() {
            if line == "};" {
                let mut s = current.take().unwrap();
                s.size = s.size.div_ceil(s.align) * s.align;
                structs.push(s);
                continue;
            }
            let decl = line.strip_suffix(';').unwrap_or_else(|| fail("a field must end with ';'"));
            let (ty, rest) = decl.split_once(' ').unwrap_or_else(|| fail("expected `type name`"));
            let (ty_size, ty_align) = match ty {
                "u32" => (4, 4),
                "u64" => (8, 8),
                t => structs.iter().find(|s| s.name == t).map(|s| (s.size, s.align)).unwrap_or_else(|| fail("unknown field type")),
            };
            let rest = rest.trim();
            let (name, count) = match rest.split_once('[') {
                Some((n, dim)) => {
                    (n.trim(), eval(dim.strip_suffix(']').unwrap_or_else(|| fail("expected ']'")), &defines).unwrap_or_else(|e| fail(&e)))
                }
                None => (rest, 1),
            };
            let offset = s.size.div_ceil(ty_align) * ty_align;
            s.fields.push(Field { name: name.to_string(), offset, size: ty_size * count });
            s.size = offset + ty_size * count;
            s.align = s.align.max(ty_align);
            continue;
        }
        if let Some(rest) = line.strip_prefix("#define ") {
            let (name, expr) = rest.split_once(' ').unwrap_or_else(|| fail("expected `#define NAME value`"));
            let v = eval(expr, &defines).unwrap_or_else(|e| fail(&e));
            defines.push((name.to_string(), v));
        } else if let Some(rest) = line.strip_prefix("struct ") {
            let name = rest.strip_suffix('{').unwrap_or_else(|| fail("expected `struct Name {`")).trim();
            current = Some(Struct { name: name.to_string(), size: 0, align: 1, fields: Vec::new() });
        } else if let Some(rest) = line.strip_prefix("static_assert(") {
            // `static_assert(sizeof(X) == n [&& alignof(X) == m], "...")`
            let cond = rest.split(", \"").next().unwrap();
            for term in cond.split("&&") {
                let (lhs, rhs) = term.split_once("==").unwrap_or_else(|| fail("expected `lhs == n`"));
                let v: u64 = rhs.trim().parse().unwrap_or_else(|_| fail("expected a number"));
                let lhs = lhs.trim();
                if !(lhs.starts_with("sizeof(") || lhs.starts_with("alignof(")) || !lhs.ends_with(')') {
                    fail("expected sizeof(X) or alignof(X)");
                }
                asserts.push((lhs.to_string(), v, lno));
            }
        } else {
            fail("not understood (see the subset this parser reads, build_abi.rs)");
        }
    }
    assert!(current.is_none(), "{}: a struct is not closed", header.display());
    // The compiler checks abi.cuh's static_asserts against its own layout; check them against
    // the layout computed here, so the two are the same.
    for (key, v, lno) in &asserts {
        let (what, name) = key.trim_end_matches(')').split_once('(').unwrap();
        let (size, align) = match name {
            "u32" => (4, 4),
            "u64" => (8, 8),
            n => match structs.iter().find(|s| s.name == n) {
                Some(s) => (s.size, s.align),
                None => panic!("{}:{lno}: static_assert names {n}, which is not defined", header.display()),
            },
        };
        let got = if what == "sizeof" { size } else { align };
        if got != *v {
            panic!("{}:{lno}: static_assert says {key} == {v}, build.rs computes {got}", header.display());
        }
    }
    for s in &structs {
        assert!(
            asserts.iter().any(|a| a.0 == format!("sizeof({})", s.name)),
            "{}: struct {} needs a static_assert of its sizeof",
            header.display(),
            s.name
        );
    }
    let mut rs = String::from("// Generated by rust/core/build.rs (build_abi.rs) from csrc_kernels/abi.cuh.\n");
    for (name, v) in &defines {
        rs += &format!("pub const {name}: u64 = {v};\n");
    }
    rs += "/// (struct, size in bytes) of every struct of abi.cuh, as C lays it out.\npub const STRUCTS: &[(&str, usize)] = &[\n";
    for s in &structs {
        rs += &format!("    ({:?}, {}),\n", s.name, s.size);
    }
    rs += "];\n/// (struct, field, offset, size in bytes) of every field of abi.cuh's structs.\npub const FIELDS: &[(&str, &str, usize, usize)] = &[\n";
    for s in &structs {
        for f in &s.fields {
            rs += &format!("    ({:?}, {:?}, {}, {}),\n", s.name, f.name, f.offset, f.size);
        }
    }
    rs += "];\n";
    std::fs::write(out.join("kernel_abi.rs"), rs).unwrap();
    let rename: HashMap<&str, &str> = RENAMED.into_iter().collect();
    let mut check = String::from(
        "// Generated by rust/core/build.rs (build_abi.rs) from csrc_kernels/abi.cuh: the Rust\n// mirrors of its structs have its layout.\nconst _: () = {\n    const fn field_size<S, F>(_: fn(&S) -> &F) -> usize {\n        std::mem::size_of::<F>()\n    }\n",
    );
    for s in &structs {
        check += &format!(
            "    assert!(std::mem::size_of::<{0}>() == {1}, \"{0}: its size differs from csrc_kernels/abi.cuh's ({1} bytes)\");\n",
            s.name, s.size
        );
        for f in &s.fields {
            let rf = rename.get(f.name.as_str()).copied().unwrap_or(&f.name);
            check += &format!(
                "    assert!(std::mem::offset_of!({0}, {1}) == {2}, \"{0}.{1}: its offset differs from csrc_kernels/abi.cuh's ({2})\");\n",
                s.name, rf, f.offset
            );
            check += &format!(
                "    assert!(field_size(|s: &{0}| &s.{1}) == {2}, \"{0}.{1}: its size differs from csrc_kernels/abi.cuh's ({2} bytes)\");\n",
                s.name, rf, f.size
            );
        }
    }
    check += "};\n";
    std::fs::write(out.join("kernel_abi_check.rs"), check).unwrap();
}

/// The value of an integer expression of abi.cuh: numbers (a `u` suffix allowed), earlier
/// names, + - * and parentheses.
fn eval(expr: &str, defines: &[(String, u64)]) -> Result<u64, String> {
    let mut toks: Vec<String> = Vec::new();
    let mut cur = String::new();
    for c in expr.chars() {
        if c.is_ascii_alphanumeric() || c == '_' {
            cur.push(c);
        } else {
            if !cur.is_empty() {
                toks.push(std::mem::take(&mut cur));
            }
            if "+-*()".contains(c) {
                toks.push(c.to_string());
            } else if !c.is_whitespace() {
                return Err(format!("unexpected character {c:?} in an expression"));
            }
        }
    }
    if !cur.is_empty() {
        toks.push(cur);
    }
    let mut pos = 0;
    let v = sum(&toks, &mut pos, defines)?;
    if pos != toks.len() {
        return Err("trailing tokens in an expression".into());
    }
    Ok(v)
}

fn sum(t: &[String], pos: &mut usize, d: &[(String, u64)]) -> Result<u64, String> {
    let mut v = product(t, pos, d)?;
    while *pos < t.len() && (t[*pos] == "+" || t[*pos] == "-") {
        let plus = t[*pos] == "+";
        *pos += 1;
        let r = product(t, pos, d)?;
        v = if plus { v + r } else { v.checked_sub(r).ok_or("a negative value")? };
    }
    Ok(v)
}

fn product(t: &[String], pos: &mut usize, d: &[(String, u64)]) -> Result<u64, String> {
    let mut v = atom(t, pos, d)?;
    while *pos < t.len() && t[*pos] == "*" {
        *pos += 1;
        v *= atom(t, pos, d)?;
    }
    Ok(v)
}

fn atom(t: &[String], pos: &mut usize, d: &[(String, u64)]) -> Result<u64, String> {
    let tok = t.get(*pos).ok_or("an expression ends early")?;
    *pos += 1;
    if tok == "(" {
        let v = sum(t, pos, d)?;
        if t.get(*pos).map(String::as_str) != Some(")") {
            return Err("expected ')'".into());
        }
        *pos += 1;
        return Ok(v);
    }
    if tok.starts_with(|c: char| c.is_ascii_digit()) {
        return tok.trim_end_matches('u').parse().map_err(|_| format!("bad number {tok}"));
    }
    d.iter().find(|(n, _)| n == tok).map(|(_, v)| *v).ok_or_else(|| format!("unknown name {tok}"))
}
