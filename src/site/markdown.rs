//! Markdown for the site: CommonMark (with tables) to HTML, and text from the data made safe to
//! splice into Markdown. Used by the prose ([`super::prose`]) and the renderer
//! ([`super::render`]) alike, so neither imports the other.

/// CommonMark (with tables) to HTML.
pub fn to_html(md: &str) -> String {
    let parser = pulldown_cmark::Parser::new_ext(md, pulldown_cmark::Options::ENABLE_TABLES);
    let mut html = String::new();
    pulldown_cmark::html::push_html(&mut html, parser);
    html
}

/// Text from data made safe to splice into Markdown: HTML-escaped (pulldown-cmark passes raw
/// HTML through) and with Markdown's punctuation backslash-escaped.
pub fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for ch in s.chars() {
        match ch {
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '&' => out.push_str("&amp;"),
            '"' => out.push_str("&quot;"),
            '\\' | '`' | '*' | '_' | '[' | ']' | '#' | '|' | '!' | '{' | '}' => {
                out.push('\\');
                out.push(ch);
            }
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escaped_text_renders_as_itself() {
        let raw = "a_b *c* <script> [x](y) | `z`";
        let html = to_html(&escape(raw));
        assert_eq!(
            html.trim(),
            "<p>a_b *c* &lt;script&gt; [x](y) | `z`</p>",
            "{html}"
        );
    }
}
